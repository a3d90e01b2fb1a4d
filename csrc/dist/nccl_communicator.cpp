// NcclCommunicator: RAII NCCL communicator for weight sync between the trainer and sampler processes.
#include "dist/nccl_communicator.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <nccl.h>

#include <cstring>

#include "common/dtype.h"
#include "common/errors.h"

namespace skyrl_tx::dist {
namespace {

void check_nccl(ncclResult_t result, const char* what) {
  SKYRL_TX_CHECK(result == ncclSuccess, Internal, "nccl: ", what, " failed: '", ncclGetErrorString(result), "'");
}

ncclDataType_t nccl_dtype(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return ncclFloat32;
    case at::kBFloat16: return ncclBfloat16;
    case at::kHalf: return ncclFloat16;
    case at::kLong: return ncclInt64;
    case at::kInt: return ncclInt32;
    case at::kByte: return ncclUint8;
    default:
      throw InvalidArgument(str_cat("nccl: unsupported dtype ", t.scalar_type()));
  }
}

void check_tensor(const at::Tensor& t, int device_index) {
  SKYRL_TX_CHECK(t.is_cuda() && t.get_device() == device_index && t.is_contiguous(), InvalidArgument,
                 "nccl: tensor must be contiguous on cuda:", device_index, " (got ", t.device(), ", shape ",
                 shape_str(t), ")");
}

}  // namespace

std::string NcclCommunicator::create_unique_id() {
  ncclUniqueId id;
  check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
  return std::string(id.internal, sizeof(id.internal));
}

NcclCommunicator::NcclCommunicator(const std::string& unique_id, int rank, int world_size, int device_index)
    : rank_(rank), world_size_(world_size), device_index_(device_index) {
  ncclUniqueId id;
  SKYRL_TX_CHECK(unique_id.size() == sizeof(id.internal), InvalidArgument, "nccl: unique id must be ",
                 sizeof(id.internal), " bytes (got ", unique_id.size(), ")");
  SKYRL_TX_CHECK(rank >= 0 && rank < world_size, InvalidArgument, "nccl: rank ", rank, " outside [0, ", world_size, ")");
  std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index));
  ncclComm_t comm = nullptr;
  check_nccl(ncclCommInitRank(&comm, world_size, id, rank), "ncclCommInitRank");
  comm_ = comm;
}

NcclCommunicator::~NcclCommunicator() {
  if (comm_ != nullptr) ncclCommDestroy(static_cast<ncclComm_t>(comm_));
}

void NcclCommunicator::broadcast(at::Tensor& tensor, int root) {
  check_tensor(tensor, device_index_);
  const c10::cuda::CUDAGuard guard(tensor.device());
  check_nccl(ncclBroadcast(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), nccl_dtype(tensor), root,
                           static_cast<ncclComm_t>(comm_), c10::cuda::getCurrentCUDAStream()),
             "ncclBroadcast");
}

void NcclCommunicator::all_reduce_sum(at::Tensor& tensor) {
  check_tensor(tensor, device_index_);
  const c10::cuda::CUDAGuard guard(tensor.device());
  check_nccl(ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), nccl_dtype(tensor), ncclSum,
                           static_cast<ncclComm_t>(comm_), c10::cuda::getCurrentCUDAStream()),
             "ncclAllReduce");
}

}  // namespace skyrl_tx::dist
