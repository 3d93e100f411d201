"""`python -m services.prefill`: a prefill worker process."""

from pdserve.engine.config import Role
from pdserve.serving.main import serve_worker
from pdserve.v1 import prefill_pb2, prefill_pb2_grpc
from services.prefill.prefiller import Prefiller
from services.prefill.servicer import PrefillServicer

if __name__ == "__main__":
    serve_worker(Role.PREFILL, lambda w: PrefillServicer(w, Prefiller(w)),
                 prefill_pb2_grpc.add_PrefillServicer_to_server,
                 prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name)
