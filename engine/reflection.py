"""Standard gRPC server reflection (grpc.reflection.v1 and v1alpha; proto.standard's stubs), so tools
like grpcurl can list and call the services without the .proto files."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from types import ModuleType

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import FileDescriptor

from proto.standard import reflection_v1_pb2 as v1_pb2
from proto.standard import reflection_v1_pb2_grpc as v1_grpc
from proto.standard import reflection_v1alpha_pb2 as v1alpha_pb2
from proto.standard import reflection_v1alpha_pb2_grpc as v1alpha_grpc

REFLECTION_SERVICES = (v1_pb2.DESCRIPTOR.services_by_name["ServerReflection"].full_name,
                       v1alpha_pb2.DESCRIPTOR.services_by_name["ServerReflection"].full_name)


class ReflectionServicer:
    """Answers reflection requests from the default descriptor pool, for the services named."""

    def __init__(self, pb: ModuleType, service_names: Iterable[str]):
        self.pb = pb
        self.service_names = sorted(service_names)
        self.pool = descriptor_pool.Default()

    async def ServerReflectionInfo(self, request_iterator: AsyncIterator, context: grpc.aio.ServicerContext
                                   ) -> AsyncIterator:
        async for request in request_iterator:
            yield self._answer(request)

    def _answer(self, request):  # -> pb.ServerReflectionResponse
        pb = self.pb
        response = pb.ServerReflectionResponse(valid_host=request.host, original_request=request)
        kind = request.WhichOneof("message_request")
        try:
            if kind == "list_services":
                response.list_services_response.service.extend(
                    pb.ServiceResponse(name=name) for name in self.service_names)
            elif kind == "file_by_filename":
                self._files(response, self.pool.FindFileByName(request.file_by_filename))
            elif kind == "file_containing_symbol":
                self._files(response, self._file_of_symbol(request.file_containing_symbol))
            elif kind == "file_containing_extension":
                raise KeyError(f"no extension {request.file_containing_extension.extension_number} of "
                               f"{request.file_containing_extension.containing_type}")
            elif kind == "all_extension_numbers_of_type":
                self.pool.FindMessageTypeByName(request.all_extension_numbers_of_type)
                response.all_extension_numbers_response.base_type_name = request.all_extension_numbers_of_type
            else:
                response.error_response.error_code = grpc.StatusCode.INVALID_ARGUMENT.value[0]
                response.error_response.error_message = "empty reflection request"
        except KeyError as e:
            response.ClearField("message_response")
            response.error_response.error_code = grpc.StatusCode.NOT_FOUND.value[0]
            response.error_response.error_message = str(e).strip("'\"") or "not found"
        return response

    def _file_of_symbol(self, symbol: str) -> FileDescriptor:
        try:
            return self.pool.FindFileContainingSymbol(symbol)
        except KeyError:
            parent = symbol.rpartition(".")[0]  # a method or field: look up its service or message
            if not parent:
                raise
            return self.pool.FindFileContainingSymbol(parent)

    @staticmethod
    def _files(response, file: FileDescriptor) -> None:
        """The file and everything it imports, each once, the file first."""
        seen: set[str] = set()
        order: list[FileDescriptor] = []

        def visit(fd: FileDescriptor) -> None:
            if fd.name in seen:
                return
            seen.add(fd.name)
            order.append(fd)
            for dep in fd.dependencies:
                visit(dep)

        visit(file)
        for fd in order:
            proto = descriptor_pb2.FileDescriptorProto()
            fd.CopyToProto(proto)
            response.file_descriptor_response.file_descriptor_proto.append(proto.SerializeToString())


def add_reflection(server: grpc.aio.Server, service_names: Iterable[str]) -> None:
    """Serves reflection (v1 and v1alpha) for `service_names` and the reflection services themselves."""
    names = [*service_names, *REFLECTION_SERVICES]
    v1_grpc.add_ServerReflectionServicer_to_server(ReflectionServicer(v1_pb2, names), server)
    v1alpha_grpc.add_ServerReflectionServicer_to_server(ReflectionServicer(v1alpha_pb2, names), server)
