// WeightSync: versioned named tensors from one rank to the others, in buckets (see weight_sync.h).
#include "dist/weight_sync.h"

#include <c10/core/GradMode.h>

#include <cstring>
#include <deque>
#include <vector>

#include "common/errors.h"

namespace skyrl_tx::dist {
namespace {

struct Entry {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  int64_t numel() const { return c10::multiply_integers(shape); }
};

/// Consecutive entries of one dtype sent as one broadcast; `offsets` are element offsets into the bucket.
struct Bucket {
  at::ScalarType dtype;
  int64_t numel = 0;
  std::vector<size_t> entries;
  std::vector<int64_t> offsets;
};

void put_i64(std::string& out, int64_t v) { out.append(reinterpret_cast<const char*>(&v), sizeof v); }

int64_t get_i64(const std::string& in, size_t& pos) {
  SKYRL_TX_CHECK(pos + sizeof(int64_t) <= in.size(), Internal, "weight sync: truncated manifest");
  int64_t v;
  std::memcpy(&v, in.data() + pos, sizeof v);
  pos += sizeof v;
  return v;
}

std::string encode(const std::vector<Entry>& entries) {
  std::string out;
  for (const Entry& e : entries) {
    put_i64(out, static_cast<int64_t>(e.name.size()));
    out += e.name;
    put_i64(out, static_cast<int64_t>(e.dtype));
    put_i64(out, static_cast<int64_t>(e.shape.size()));
    for (int64_t d : e.shape) put_i64(out, d);
  }
  return out;
}

std::vector<Entry> decode(const std::string& in, int64_t count) {
  std::vector<Entry> entries;
  size_t pos = 0;
  for (int64_t i = 0; i < count; ++i) {
    Entry e;
    const int64_t length = get_i64(in, pos);
    SKYRL_TX_CHECK(length >= 0 && pos + size_t(length) <= in.size(), Internal, "weight sync: truncated manifest");
    e.name = in.substr(pos, size_t(length));
    pos += size_t(length);
    e.dtype = static_cast<at::ScalarType>(get_i64(in, pos));
    const int64_t ndim = get_i64(in, pos);
    for (int64_t d = 0; d < ndim; ++d) e.shape.push_back(get_i64(in, pos));
    entries.push_back(std::move(e));
  }
  return entries;
}

/// The same plan on every rank, from the manifest alone.
std::vector<Bucket> plan_buckets(const std::vector<Entry>& entries, int64_t bucket_bytes) {
  std::vector<Bucket> buckets;
  Bucket current;
  auto flush = [&] {
    if (!current.entries.empty()) buckets.push_back(std::move(current));
    current = Bucket();
  };
  for (size_t i = 0; i < entries.size(); ++i) {
    const int64_t numel = entries[i].numel();
    if (numel == 0) continue;  // received as an empty tensor, nothing on the wire
    const int64_t bytes = numel * int64_t(c10::elementSize(entries[i].dtype));
    const int64_t current_bytes = current.numel * (current.entries.empty() ? 0 : int64_t(c10::elementSize(current.dtype)));
    if (!current.entries.empty() && (current.dtype != entries[i].dtype || current_bytes + bytes > bucket_bytes)) {
      flush();
    }
    current.dtype = entries[i].dtype;
    current.entries.push_back(i);
    current.offsets.push_back(current.numel);
    current.numel += numel;
    if (bytes >= bucket_bytes) flush();  // a large tensor: a bucket of its own
  }
  flush();
  return buckets;
}

}  // namespace

WeightSync::WeightSync(std::shared_ptr<Collectives> group, int root, int64_t bucket_bytes)
    : group_(std::move(group)), root_(root), bucket_bytes_(bucket_bytes) {
  SKYRL_TX_CHECK(group_, InvalidArgument, "WeightSync: no group");
  SKYRL_TX_CHECK(root >= 0 && root < group_->world_size(), InvalidArgument, "WeightSync: root ", root,
                 " is not a rank of ", group_->world_size());
  SKYRL_TX_CHECK(bucket_bytes >= 1, InvalidArgument, "WeightSync: bucket_bytes must be >= 1 (got ", bucket_bytes, ")");
}

std::map<std::string, at::Tensor> WeightSync::sync(int64_t version, const std::map<std::string, at::Tensor>& tensors,
                                                   c10::Device device) {
  c10::NoGradGuard no_grad;
  const auto started = std::chrono::steady_clock::now();
  const bool root = is_root();
  SKYRL_TX_CHECK(root || tensors.empty(), InvalidArgument, "WeightSync: only the root (rank ", root_,
                 ") sends tensors; rank ", group_->rank(), " passed ", tensors.size());
  const auto index_options = at::TensorOptions().dtype(at::kLong).device(device);
  // 1. The manifest: [version, bytes, count], then its bytes.
  std::vector<Entry> entries;
  std::vector<at::Tensor> sources;  // root: the tensors, in manifest order
  std::string manifest;
  if (root) {
    for (const auto& [name, t] : tensors) {
      entries.push_back({name, t.scalar_type(), t.sizes().vec()});
      sources.push_back(t);
    }
    manifest = encode(entries);
  }
  at::Tensor header = root ? at::tensor({version, int64_t(manifest.size()), int64_t(entries.size())}, at::kLong)
                                 .to(device)
                           : at::zeros({3}, index_options);  // [3]
  group_->broadcast(header, root_);
  at::Tensor head = header.to(at::kCPU);
  version = head[0].item<int64_t>();
  const int64_t manifest_bytes = head[1].item<int64_t>(), count = head[2].item<int64_t>();
  at::Tensor manifest_tensor = at::empty({manifest_bytes}, at::TensorOptions().dtype(at::kByte));  // [bytes]
  if (root) std::memcpy(manifest_tensor.data_ptr(), manifest.data(), manifest.size());
  if (manifest_bytes > 0) {
    at::Tensor on_device = manifest_tensor.to(device);
    group_->broadcast(on_device, root_);
    manifest_tensor = on_device.to(at::kCPU);
  }
  if (!root) {
    manifest.assign(reinterpret_cast<const char*>(manifest_tensor.data_ptr()), size_t(manifest_bytes));
    entries = decode(manifest, count);
  }

  // 2. The payload, bucket by bucket.
  const std::vector<Bucket> buckets = plan_buckets(entries, bucket_bytes_);
  std::map<std::string, at::Tensor> received;
  std::deque<std::pair<at::Tensor, PendingCollective>> in_flight;  // root: at most two buckets at once
  std::vector<std::pair<at::Tensor, PendingCollective>> issued;      // receivers: every bucket issued at once
  int64_t bytes = 0;
  for (const Bucket& bucket : buckets) {
    at::Tensor buffer;
    if (root) {
      if (bucket.entries.size() == 1 && sources[bucket.entries[0]].device() == device &&
          sources[bucket.entries[0]].is_contiguous()) {
        buffer = sources[bucket.entries[0]].view({-1});  // sent in place
      } else {
        buffer = at::empty({bucket.numel}, at::TensorOptions().dtype(bucket.dtype).device(device));  // [numel]
        for (size_t k = 0; k < bucket.entries.size(); ++k) {
          const at::Tensor& source = sources[bucket.entries[k]];
          buffer.narrow(0, bucket.offsets[k], source.numel()).copy_(source.reshape({-1}));
        }
      }
      in_flight.emplace_back(buffer, group_->broadcast_async(buffer, root_));
      if (in_flight.size() > 2) {  // bucket k - 2 done before packing k + 1: bounded memory, k and k - 1 overlap
        in_flight.front().second.wait();
        in_flight.pop_front();
      }
    } else {
      buffer = at::empty({bucket.numel}, at::TensorOptions().dtype(bucket.dtype).device(device));  // [numel]
      issued.emplace_back(buffer, group_->broadcast_async(buffer, root_));
      for (size_t k = 0; k < bucket.entries.size(); ++k) {
        const Entry& e = entries[bucket.entries[k]];
        received[e.name] = buffer.narrow(0, bucket.offsets[k], e.numel()).view(e.shape);
      }
    }
    bytes += bucket.numel * int64_t(c10::elementSize(bucket.dtype));
  }
  for (auto& [buffer, pending] : in_flight) pending.wait();
  for (auto& [buffer, pending] : issued) pending.wait();
  if (!root) {
    for (const Entry& e : entries) {
      if (e.numel() == 0) received[e.name] = at::empty(e.shape, at::TensorOptions().dtype(e.dtype).device(device));
    }
  }
  last_ = {version, int64_t(entries.size()), bytes, int64_t(buckets.size()),
           std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count()};
  return root ? tensors : received;
}

}  // namespace skyrl_tx::dist
