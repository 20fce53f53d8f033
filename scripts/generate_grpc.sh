#!/usr/bin/env bash
# Regenerate src/paraloom/serving/grpc/inference.desc from inference.proto.
#
# inference.desc is the compiled proto (a serialized FileDescriptorSet, what a generated
# *_pb2.py embeds). It is committed, so a fresh install needs no protoc. paraloom builds its
# message classes from it in a private descriptor pool: they never clash with tritonclient's
# or KServe's generated classes of the same package in one process, and no protobuf gencode
# version check ties the install to one protobuf major version. Run from the repository root;
# it uses grpcio-tools from a throwaway venv (GEN_VENV) so nothing in yours changes.
set -euo pipefail
venv="${GEN_VENV:-${TMPDIR:-/tmp}/paraloom-grpc-gen}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -c "import grpc_tools" 2>/dev/null || "$venv/bin/pip" install -q grpcio-tools
cd src/paraloom/serving/grpc
"$venv/bin/python" -m grpc_tools.protoc -I. --descriptor_set_out=inference.desc inference.proto
echo "wrote $(pwd)/inference.desc"
