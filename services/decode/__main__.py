"""`python -m services.decode`: a decode worker process."""

from pdserve.engine.config import Role
from pdserve.v1 import decode_pb2, decode_pb2_grpc
from pdserve.worker.main import serve_worker
from services.decode.decoder import Decoder
from services.decode.servicer import DecodeServicer

if __name__ == "__main__":
    serve_worker(Role.DECODE, lambda w: DecodeServicer(w, Decoder(w)),
                 decode_pb2_grpc.add_DecodeServicer_to_server,
                 decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name)
