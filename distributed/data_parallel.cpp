#include "distributed/data_parallel.h"

#include "common/check.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>

#include <map>
#include <sstream>
#include <tuple>

namespace dwgraph::distributed {

namespace {

c10::intrusive_ptr<c10d::Work> all_reduce_sum(const c10::intrusive_ptr<c10d::ProcessGroup>& group, at::Tensor t) {
  std::vector<at::Tensor> tensors{std::move(t)};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  return group->allreduce(tensors, opts);
}

}  // namespace

DataParallelReducer::DataParallelReducer(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                         std::vector<ReducedParameter> params, std::vector<ReducedModule> modules,
                                         int64_t bucket_cap_bytes)
    : group_(std::move(group)), params_(std::move(params)), modules_(std::move(modules)) {
  const char* api = "dwgraph.distributed.DataParallelReducer";
  DWGRAPH_CHECK_ARG(group_, api, ": argument 'process_group' must be a process group, got None");
  DWGRAPH_CHECK_ARG(!params_.empty(), api, ": argument 'params' must hold at least one parameter, got none");
  DWGRAPH_CHECK_ARG(bucket_cap_bytes > 0, api, ": argument 'bucket_cap_mb' must be > 0, got ", bucket_cap_bytes,
                    " bytes");
  for (size_t m = 0; m < modules_.size(); ++m) {
    for (size_t p : modules_[m].params) {
      DWGRAPH_CHECK_ARG(p < params_.size(), api, ": module '", modules_[m].name, "' names parameter ", p, " of ",
                        params_.size());
    }
  }
  // Buckets in reverse registration order (roughly the order weight steps land), one dtype
  // and device per bucket, each up to the cap. Every rank builds the same buckets from the
  // same model, so launching them in index order matches the collectives across ranks.
  bucket_of_.assign(params_.size(), 0);
  std::map<std::tuple<int, int, int64_t>, size_t> open;  // (dtype, device type, index) -> bucket
  for (size_t k = params_.size(); k-- > 0;) {
    const ReducedParameter& p = params_[k];
    DWGRAPH_CHECK_ARG(!p.owners.empty(), api, ": parameter '", p.name, "' has no module that lands it");
    const auto key = std::make_tuple(static_cast<int>(p.grad_dtype), static_cast<int>(p.param.device().type()),
                                     static_cast<int64_t>(p.param.device().index()));
    const int64_t bytes = p.param.numel() * static_cast<int64_t>(c10::elementSize(p.grad_dtype));
    auto it = open.find(key);
    if (it == open.end() ||
        (buckets_[it->second].numel * static_cast<int64_t>(c10::elementSize(p.grad_dtype)) + bytes > bucket_cap_bytes &&
         !buckets_[it->second].params.empty())) {
      buckets_.emplace_back();
      it = open.insert_or_assign(key, buckets_.size() - 1).first;
    }
    Bucket& b = buckets_[it->second];
    b.params.push_back(k);
    b.offsets.push_back(b.numel);
    b.numel += p.param.numel();
    bucket_of_[k] = it->second;
  }
  for (auto& b : buckets_) {
    const ReducedParameter& first = params_[b.params.front()];
    b.flat = at::empty({b.numel + 1}, first.param.options().dtype(first.grad_dtype));
  }
  filled_.assign(params_.size(), false);
  landed_.assign(modules_.size(), false);
  ready_.assign(modules_.size(), false);
  ready_count_.assign(modules_.size(), 0);
  last_ready_count_.assign(modules_.size(), 0);
}

bool DataParallelReducer::drained(size_t m) const {
  // Pending in a graphed callable counts: a graphed module's replayed backward holds its
  // work outside the queue until its backward_dw() (ops::WgradStore::num_pending).
  return !modules_[m].store || modules_[m].store->num_pending() == 0;
}

std::string DataParallelReducer::describe_module(size_t m) const { return "'" + modules_[m].name + "'"; }

void DataParallelReducer::begin_forward(bool sync) {
  const std::lock_guard<std::mutex> lock(mu_);
  bool started = next_launch_ > 0;
  for (bool r : ready_) started = started || r;
  DWGRAPH_CHECK_STATE(!started, "dwgraph.distributed: a new forward while the previous step's deferred gradients are "
                      "being reduced (", next_launch_, " of ", buckets_.size(), " buckets launched); call finish() "
                      "after the last backward_dw() of each step and before optimizer.step(), or run the "
                      "forwards that accumulate into the same step inside no_sync()");
  sync_ = sync;
}

void DataParallelReducer::fill(size_t p, const at::Tensor& buffer) {
  const ReducedParameter& rp = params_[p];
  Bucket& b = buckets_[bucket_of_[p]];
  size_t slot = 0;
  while (b.params[slot] != p) ++slot;
  at::Tensor dst = b.flat.narrow(0, b.offsets[slot], rp.param.numel()).view(rp.param.sizes());
  if (!buffer.defined()) {
    dst.zero_();
  } else {
    DWGRAPH_CHECK_ARG(buffer.scalar_type() == rp.grad_dtype && buffer.sizes() == rp.param.sizes(),
                      "dwgraph.distributed: the ", rp.fused ? "main_grad" : ".grad", " of parameter '", rp.name,
                      "' must be a ", rp.grad_dtype, " tensor of shape ", rp.param.sizes(), " as when the reducer "
                      "was built, got ", buffer.scalar_type(), " ", buffer.sizes());
    dst.copy_(buffer);
  }
  if (!filled_[p]) {
    filled_[p] = true;
    ++b.filled;
  }
}

void DataParallelReducer::launch(size_t b, bool complete) {
  Bucket& bucket = buckets_[b];
  bucket.flat.narrow(0, bucket.numel, 1).fill_(complete ? 1 : 0);
  bucket.work = all_reduce_sum(group_, bucket.flat);
}

void DataParallelReducer::launch_ready() {
  // In bucket order on every rank: a ready bucket waits for the ones before it.
  while (next_launch_ < buckets_.size() && buckets_[next_launch_].filled == buckets_[next_launch_].params.size()) {
    launch(next_launch_, /*complete=*/true);
    ++next_launch_;
  }
}

void DataParallelReducer::on_landed(size_t module, const std::vector<at::Tensor>& buffers) {
  const std::lock_guard<std::mutex> lock(mu_);
  DWGRAPH_CHECK_ARG(module < modules_.size(), "dwgraph.distributed: module index ", module, " out of range (",
                    modules_.size(), " modules)");
  const ReducedModule& m = modules_[module];
  DWGRAPH_CHECK_ARG(buffers.size() == m.params.size(), "dwgraph.distributed: module ", describe_module(module),
                    " expected ", m.params.size(), " gradient buffers, got ", buffers.size());
  for (size_t p : m.params) {
    DWGRAPH_CHECK_STATE(bucket_of_[p] >= next_launch_, "dwgraph.distributed: module ", describe_module(module),
                        ": weight gradients landed after the all-reduce of its parameter '", params_[p].name,
                        "' started in this step. Every backward_dw() of a step must come before finish(); "
                        "accumulate further microbatches inside no_sync(), and call finish() before a new step");
  }
  landed_[module] = true;
  if (!sync_ || !drained(module)) return;  // more of this step's contributions will come
  ready_[module] = true;
  ++ready_count_[module];
  for (size_t i = 0; i < m.params.size(); ++i) {
    const size_t p = m.params[i];
    bool all = true;
    for (size_t o : params_[p].owners) all = all && ready_[o];
    if (all) fill(p, buffers[i]);
  }
  launch_ready();
}

void DataParallelReducer::finish(const std::vector<std::vector<at::Tensor>>& buffers) {
  const std::lock_guard<std::mutex> lock(mu_);
  DWGRAPH_CHECK_ARG(buffers.size() == modules_.size(), "dwgraph.distributed.finish: expected the buffers of ",
                    modules_.size(), " modules, got ", buffers.size());
  std::vector<std::string> problems;
  std::vector<bool> complete(modules_.size());
  for (size_t m = 0; m < modules_.size(); ++m) {
    DWGRAPH_CHECK_ARG(buffers[m].size() == modules_[m].params.size(), "dwgraph.distributed.finish: module ",
                      describe_module(m), " expected ", modules_[m].params.size(), " gradient buffers, got ",
                      buffers[m].size());
    complete[m] = landed_[m] && drained(m);
    if (!landed_[m]) {
      problems.push_back(c10::str("module ", describe_module(m), ": no weight gradient landed since the last "
                                  "finish() (it did not run, its backward_dw() was not called, or this step was finished already)"));
    } else if (!drained(m)) {
      problems.push_back(c10::str("module ", describe_module(m), ": ", modules_[m].store->num_pending(),
                                  " backward(s) still queued or pending in a graph; call backward_dw() once per "
                                  "backward before finish() (discard_wgrad_units() drops work of an abandoned step)"));
    }
  }
  std::vector<at::Tensor> current(params_.size());
  for (size_t m = 0; m < modules_.size(); ++m) {
    for (size_t i = 0; i < modules_[m].params.size(); ++i) current[modules_[m].params[i]] = buffers[m][i];
  }
  // Note [Agreement flag]: every bucket is launched on every rank, complete or not.
  try {
    for (size_t b = next_launch_; b < buckets_.size(); ++b) {
      for (size_t p : buckets_[b].params) {
        bool owners_complete = true;
        for (size_t o : params_[p].owners) owners_complete = owners_complete && complete[o];
        if (!filled_[p] && owners_complete) fill(p, current[p]);
      }
      launch(b, buckets_[b].filled == buckets_[b].params.size());
    }
    next_launch_ = buckets_.size();
    for (auto& b : buckets_) b.work->wait();
  } catch (...) {
    reset_step(/*fresh_buckets=*/true);
    throw;
  }
  const int64_t world = group_->getSize();
  const int64_t agreeing = count_agreeing(group_, problems.empty(), buckets_.front().flat.device());
  std::vector<std::string> incomplete;
  for (const auto& b : buckets_) {
    const auto ranks = static_cast<int64_t>(b.flat.narrow(0, b.numel, 1).item<double>());
    if (ranks == world) continue;
    std::vector<std::string> names;
    for (size_t p : b.params) {
      for (size_t o : params_[p].owners) names.push_back(describe_module(o));
    }
    incomplete.push_back(c10::str(world - ranks, " of ", world, " ranks lack gradients of modules ",
                                  c10::Join(", ", names)));
  }
  if (agreeing != world || !incomplete.empty()) {
    reset_step();
    std::ostringstream msg;
    msg << "dwgraph.distributed.finish(): " << world - agreeing << " of " << world
        << " ranks did not land every deferred weight gradient of this step; no gradient was written.";
    for (const auto& s : problems) msg << "\n  this rank: " << s;
    for (const auto& s : incomplete) msg << "\n  " << s;
    DWGRAPH_CHECK_STATE(false, msg.str());
  }
  for (auto& b : buckets_) {
    b.flat.narrow(0, 0, b.numel).div_(world);
    for (size_t slot = 0; slot < b.params.size(); ++slot) {
      const size_t p = b.params[slot];
      const ReducedParameter& rp = params_[p];
      const at::Tensor avg = b.flat.narrow(0, b.offsets[slot], rp.param.numel()).view(rp.param.sizes());
      if (rp.fused) {
        current[p].copy_(avg);
        continue;
      }
      at::Tensor& grad = rp.param.mutable_grad();
      if (grad.defined()) {
        grad.copy_(avg);
      } else {
        grad = avg.clone();
      }
    }
  }
  reset_step();
}

void DataParallelReducer::abandon() {
  const std::lock_guard<std::mutex> lock(mu_);
  reset_step(/*fresh_buckets=*/true);
}

void DataParallelReducer::reset_step(bool fresh_buckets) {
  // An all-reduce nobody waited for may still write its bucket (its work keeps the old
  // buffer alive): the next step gets new ones.
  for (size_t b = 0; fresh_buckets && b < next_launch_; ++b) buckets_[b].flat = at::empty_like(buckets_[b].flat);
  last_ready_count_ = ready_count_;
  ready_count_.assign(modules_.size(), 0);
  filled_.assign(params_.size(), false);
  landed_.assign(modules_.size(), false);
  ready_.assign(modules_.size(), false);
  for (auto& b : buckets_) {
    b.filled = 0;
    b.work.reset();
  }
  next_launch_ = 0;
  sync_ = true;
}

bool DataParallelReducer::pending() const {
  const std::lock_guard<std::mutex> lock(mu_);
  bool any = next_launch_ > 0;
  for (bool l : landed_) any = any || l;
  return any;
}

std::vector<int64_t> DataParallelReducer::ready_counts() const {
  const std::lock_guard<std::mutex> lock(mu_);
  return last_ready_count_;
}

size_t DataParallelReducer::num_launched() const {
  const std::lock_guard<std::mutex> lock(mu_);
  return next_launch_;
}

int64_t count_agreeing(const c10::intrusive_ptr<c10d::ProcessGroup>& group, bool ok, const at::Device& device) {
  at::Tensor t = at::full({1}, ok ? 1.0 : 0.0, at::TensorOptions().dtype(at::kFloat).device(device));
  all_reduce_sum(group, t)->wait();
  return static_cast<int64_t>(t.item<double>());
}

}  // namespace dwgraph::distributed
