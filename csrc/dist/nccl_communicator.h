// NcclCommunicator: RAII NCCL communicator for weight sync between the trainer and sampler processes.
#pragma once

#include <ATen/ATen.h>

#include <string>

namespace skyrl_tx::dist {

/// Built only with CUDA + NCCL. Collectives run on the current CUDA stream of the tensor's device.
class NcclCommunicator {
 public:
  /// A fresh ncclUniqueId as raw bytes, to be shared out of band (e.g. over the engine's RPC).
  static std::string create_unique_id();
  /// Joins the group. unique_id: bytes from create_unique_id on rank 0. Throws InvalidArgument/Internal.
  NcclCommunicator(const std::string& unique_id, int rank, int world_size, int device_index);
  ~NcclCommunicator();
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  /// In-place broadcast of a contiguous CUDA tensor from `root`.
  void broadcast(at::Tensor& tensor, int root);
  /// In-place sum all-reduce of a contiguous CUDA tensor.
  void all_reduce_sum(at::Tensor& tensor);
  int rank() const { return rank_; }
  int world_size() const { return world_size_; }

 private:
  void* comm_ = nullptr;  // ncclComm_t, kept opaque so this header needs no nccl.h
  int rank_;
  int world_size_;
  int device_index_;
};

}  // namespace skyrl_tx::dist
