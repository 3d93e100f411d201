"""`python -m services.prefill`: a prefill worker process."""

from pdserve.engine.config import Role
from pdserve.v1 import prefill_pb2, prefill_pb2_grpc
from pdserve.worker.main import serve_worker
from services.prefill.offloader import Offloader
from services.prefill.prefiller import Prefiller
from services.prefill.servicer import PrefillServicer


def make_servicer(worker) -> PrefillServicer:
    offloader = Offloader(worker, worker.cfg.offload_blocks)
    offloader.start()
    return PrefillServicer(worker, Prefiller(worker))


if __name__ == "__main__":
    serve_worker(Role.PREFILL, make_servicer,
                 prefill_pb2_grpc.add_PrefillServicer_to_server,
                 prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name)
