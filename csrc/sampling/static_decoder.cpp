// StaticDecoder: decode steps at bucketed shapes with row-dense LoRA; on a GPU, one CUDA graph per shape.
#include "sampling/static_decoder.h"

#include <c10/core/GradMode.h>

#include <algorithm>

#include "common/errors.h"

#ifdef SKYRL_TX_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace skyrl_tx::sampling {
namespace {

int64_t round_up(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

// Rows round up to a power of two: log2(max_rows) shapes, at most 2x wasted rows (cheap: decode reads weights).
int64_t row_bucket(int64_t rows, int64_t max_rows) {
  int64_t bucket = 1;
  while (bucket < rows) bucket *= 2;
  return std::min(bucket, max_rows);
}

}  // namespace

#ifdef SKYRL_TX_WITH_CUDA
struct StaticDecoder::GraphPool {
  at::cuda::MempoolId_t id = at::cuda::graph_pool_handle();
};
#else
struct StaticDecoder::GraphPool {};
#endif

struct StaticDecoder::Shape {
  int64_t rows = 0, keys = 0;
  at::Tensor host_inputs;  // [3, rows] int64 (pinned on a GPU): tokens, positions, slots
  at::Tensor inputs;       // [3, rows] int64 on the device: what the step reads
  at::Tensor batch_rows;   // [rows] = arange(rows)
  at::Tensor logits;       // [rows, vocab] float: logits_by_rows_[rows]
#ifdef SKYRL_TX_WITH_CUDA
  std::unique_ptr<at::cuda::CUDAGraph> graph;
#endif
};

StaticDecoder::StaticDecoder(const models::CausalLM& model, const KvCache& cache, int64_t max_rows,
                             int64_t max_length, bool cuda_graphs)
    : model_(model), cache_(cache), max_rows_(max_rows), max_length_(max_length), cuda_graphs_(cuda_graphs) {
#ifdef SKYRL_TX_WITH_CUDA
  const at::Device device = model.options().device;
  SKYRL_TX_CHECK(!cuda_graphs || device.is_cuda(), InvalidArgument,
                 "cuda_graphs: decode graphs need a CUDA device (got ", device.str(), ")");
  if (cuda_graphs) pool_ = std::make_unique<GraphPool>();
#else
  SKYRL_TX_CHECK(!cuda_graphs, InvalidArgument, "cuda_graphs: this build of skyrl_tx has no CUDA path");
#endif
}

StaticDecoder::~StaticDecoder() = default;

StaticDecoder::Shape& StaticDecoder::shape_for(int64_t rows, int64_t keys) {
  auto& slot = shapes_[{rows, keys}];
  if (slot) return *slot;
  slot = std::make_unique<Shape>();
  Shape& shape = *slot;
  const at::Device device = model_.options().device;
  shape.rows = rows;
  shape.keys = keys;
  shape.host_inputs = at::zeros({3, rows}, at::TensorOptions().dtype(at::kLong).pinned_memory(device.is_cuda()));
  shape.inputs = at::zeros({3, rows}, at::TensorOptions().dtype(at::kLong).device(device));
  shape.batch_rows = at::arange(rows, shape.inputs.options());
  at::Tensor& logits = logits_by_rows_[rows];
  if (!logits.defined()) logits = at::empty({rows, model_.config().vocab_size}, shape.inputs.options().dtype(at::kFloat));
  shape.logits = logits;
  return shape;
}

void StaticDecoder::forward(Shape& shape) const {
  c10::NoGradGuard no_grad;
  const int64_t rows = shape.rows;
  at::Tensor tokens = shape.inputs.select(0, 0), positions = shape.inputs.select(0, 1);
  at::Tensor slots = shape.inputs.select(0, 2);  // each [rows]
  models::KvCacheView view;
  view.keys = &cache_.keys();
  view.values = &cache_.values();
  view.decode = true;
  view.positions = positions;
  view.attend_len = shape.keys;
  view.batch_rows = shape.batch_rows;
  // Row b sees keys j <= position_b (its context and the token written now); padding keys are masked.
  view.attend_mask = (at::arange(shape.keys, positions.options()).unsqueeze(0) <= positions.unsqueeze(1))
                         .view({rows, 1, 1, shape.keys});
  const auto& options = model_.options();
  const lora::AdapterSegments segments =  // [rows, num_slots * max_rank] mask, from the device-side slots
      lora::AdapterSegments::row_dense(lora::slot_columns(slots, options.num_slots, options.max_rank));
  at::Tensor hidden = model_.hidden_states(tokens.view({rows, 1}), positions.view({rows, 1}), models::AttentionMask{},
                                           segments, &view);  // [rows, hidden]
  shape.logits.copy_(model_.logits(hidden, segments));
}

at::Tensor StaticDecoder::step(const std::vector<int64_t>& tokens, const std::vector<int64_t>& positions,
                               const std::vector<int64_t>& slots, int64_t attend_len) {
  const int64_t batch = static_cast<int64_t>(tokens.size());
  SKYRL_TX_INTERNAL_ASSERT(batch >= 1 && batch <= max_rows_ && positions.size() == tokens.size() &&
                               slots.size() == tokens.size(),
                           "static decode: bad batch");
  const int64_t rows = row_bucket(batch, max_rows_);
  const int64_t keys = std::min(round_up(attend_len, kKeyBucket), max_length_);
  Shape& shape = shape_for(rows, keys);
  // Padding rows decode token 0 at the last position of their cache rows, with no adapter: a row the prefix cache
  // keeps (sampling/prefix_cache.h) never holds that position (a sequence's last token is never written), and a
  // free row's is rewritten before it is read.
  at::Tensor host = shape.host_inputs;
  host.zero_();
  host.select(0, 1).fill_(max_length_ - 1);
  auto fill = [&](int64_t which, const std::vector<int64_t>& values) {
    std::copy(values.begin(), values.end(), host.select(0, which).data_ptr<int64_t>());
  };
  fill(0, tokens);
  fill(1, positions);
  fill(2, slots);
  // NOTE: non_blocking from pinned memory; the host buffer is not rewritten before the step has read it
  // because the caller synchronises on the sampled tokens every step.
  shape.inputs.copy_(host, /*non_blocking=*/true);
#ifdef SKYRL_TX_WITH_CUDA
  if (cuda_graphs_) {
    const c10::cuda::CUDAGuard device_guard(model_.options().device);  // streams and pool of the model's GPU
    // Adapter factors or scalings that changed since the last step (an optim_step, a new adapter in a slot)
    // reach the graph's inputs here, in place; inside a capture they are then current, so none is recorded.
    model_.prepare_lora_inference();
    if (!shape.graph) {
      // Warm-up on a side stream (lazy cuBLAS/attention initialisation must not be captured); it also computes
      // this step, so the capture is followed by a replay of the same, idempotent work.
      const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream();
      const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool();
      current.synchronize();
      {
        const c10::cuda::CUDAStreamGuard guard(side);
        forward(shape);
        side.synchronize();
        auto graph = std::make_unique<at::cuda::CUDAGraph>();
        graph->capture_begin(pool_->id);
        forward(shape);
        graph->capture_end();
        shape.graph = std::move(graph);
      }
    }
    shape.graph->replay();
    return shape.logits.narrow(0, 0, batch);
  }
#endif
  forward(shape);
  return shape.logits.narrow(0, 0, batch);
}

}  // namespace skyrl_tx::sampling
