// AdamW for the parameters of AdamW groups (runtime/adamw_state.h), one path for the
// single-process and every distributed step.
#include "distmuon/error.h"
#include "runtime/adamw_state.h"
#include "runtime/muon_batch.h"  // copy_block

namespace distmuon {

void AdamWState::begin(const StepContext& ctx) {
  if (record.adam_params.empty()) return;
  if (!dummy) dummy = backend.alloc(64);
  if (!reduces_gradients()) return;
  if (!stage) {
    size_t bytes = 0;
    for (int i : record.adam_params) {
      offset.push_back(static_cast<int64_t>(bytes));
      bytes +=
          static_cast<size_t>(registry.params[i].numel) * dtype_size(registry.params[i].spec.dtype);
    }
    stage = backend.alloc(std::max<size_t>(bytes, 1));
  }
  for (size_t k = 0; k < record.adam_params.size(); ++k) {
    const int i = record.adam_params[k];
    if (!ctx.active[i]) continue;
    const Param& p = registry.params[i];
    void* dst = stage.as<char>() + offset[k];
    if (ctx.has_local[i])
      copy_block(backend, ctx.data[i].grad, ctx.data[i].grad_dtype, dst, p.spec.dtype, 1, p.numel);
    else
      backend.fill_zero(dst, static_cast<size_t>(p.numel) * dtype_size(p.spec.dtype));
  }
  // One launch for every parameter's all-reduce; only collectives inside the group (a rank failing
  // inside it would launch part of the group and leave the others waiting until the timeout).
  dist.world->grouped([&] {
    for (size_t k = 0; k < record.adam_params.size(); ++k) {
      const int i = record.adam_params[k];
      if (!ctx.active[i]) continue;
      const Param& p = registry.params[i];
      void* dst = stage.as<char>() + offset[k];
      handles.push_back(
          dist.world->all_reduce(dst, dst, p.numel, comm_type(p.spec.dtype), ReduceOp::kSum));
    }
  });
}

void AdamWState::check(const StepContext& ctx) {
  if (record.adam_params.empty()) return;
  dist.wait_on_stream(handles);
  slots.clear();
  for (size_t k = 0; k < record.adam_params.size(); ++k) {
    const int i = record.adam_params[k];
    const Param& p = registry.params[i];
    const ParamData& d = ctx.data[i];
    // Every AdamW parameter keeps its slot (empty when idle here), so statuses line up on
    // every rank.
    if (!ctx.active[i] || p.local_numel == 0) {
      // An empty shard of a stepping tensor still counts the step, as its other shards do.
      void* z = dummy.data();
      slots.push_back({z, z, z, z, DType::kF32, DType::kF32, 0,
                       ctx.active[i] ? record.step_count(i) : nullptr, record.scalars.adam(k)});
      continue;
    }
    AdamSlot s{
        d.param,      d.grad,        p.state0.data(),      p.state1.data(),       p.spec.dtype,
        d.grad_dtype, p.local_numel, record.step_count(i), record.scalars.adam(k)};
    if (reduces_gradients()) {
      s.grad = stage.as<char>() + offset[k];
      s.grad_dtype = p.spec.dtype;
      if (dist.options.grad_mean && dist.world_size > 1) {
        BatchRef g = BatchRef::packed(const_cast<void*>(s.grad), s.grad_dtype, 1, 1, p.numel);
        backend.lincomb(1.0 / dist.world_size, g, 0.0, nullptr, 0.0, g);
      }
    }
    slots.push_back(s);
  }
  int32_t* status = record.adam_status();
  backend.adamw_check(slots, status);
  // Shard holders must skip a tensor whose rows are non-finite anywhere.
  if (dist.world && !ctx.raise && is_sharded_mode(dist.options.mode)) {
    CommHandle h =
        dist.shard->all_reduce(status, status, static_cast<int64_t>(record.adam_params.size()),
                               CommType::kI32, ReduceOp::kMax);
    dist.wait_on_stream(h);
  }
}

void AdamWState::update() {
  if (record.adam_params.empty()) return;
  int32_t* status = record.adam_status();
  backend.adamw_update(slots, status);
  backend.count_status(status, static_cast<int64_t>(record.adam_params.size()),
                       record.skip_counter.as<int64_t>());
}

}  // namespace distmuon
