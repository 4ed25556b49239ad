"""Proves the tests can fail: applies each deliberate mistake to a temporary copy of the
repository and runs the tests that must catch it.

  .venv/bin/python ci/mutations.py             every mutation (about 15 minutes on 2 cores)
  .venv/bin/python ci/mutations.py NAME [...]  only these (see --list)
  .venv/bin/python ci/mutations.py --list

Not part of the CI run. For each mutation the copy gets exactly one textual change (the
script stops if the text to change is not found exactly once, so it cannot silently test
nothing), then pytest runs the named tests there with PYTHONPATH on the copy (worker
processes, horovodrun ranks and mpirun ranks import the mutated package too). A
mutation is CAUGHT when at least one of those tests fails; the failing tests are listed.
First, a control run of every selected test on the unmutated copy must pass, so that a
failure means the mutation. Prints a table and writes it to --out (default:
mutations.md in the current folder) as Markdown.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
D = "tests/distributed"
PARITY = f"{D}/test_parity.py"
AGREEMENT = f"{D}/test_agreement.py"
WRAPPER_PARITY = f"{D}/test_wrapper_parity.py"
ONE_AGGREGATION_FILE = f"{D}/test_one_aggregation.py"
BACKEND_OPTIONS = f"{D}/test_backend_options.py"
LIFECYCLE = f"{D}/test_process_lifecycle.py"
SECURITY = "tests/distributed/test_security.py::test_a_local_job_listens_on_loopback_only"
SHARDED = f"{D}/test_sharded_state.py"
# Tests run with the strategy as a parameter ("mirrored-2", "multiworker", "horovod-gloo",
# ...): a test id names every strategy's cases, or one parameter ("...[mirrored-eager-0]").
STRATEGY_PARITY = f"{PARITY}::test_matches_single_device"
# What tests/distributed/test_mirrored.py held (the MirroredStrategy worker jobs, 2 and 4 replicas).
MIRRORED = [STRATEGY_PARITY, f"{PARITY}::test_matches_stock_keras_on_one_device",
            f"{PARITY}::test_keras_global_clipnorm_anchor_does_not_match",
            f"{ONE_AGGREGATION_FILE}::test_exactly_one_collective_per_step",
            f"{WRAPPER_PARITY}::test_weight_wrappers_match_single_device",
            f"{WRAPPER_PARITY}::test_differential_privacy_matches_single_device",
            f"{WRAPPER_PARITY}::test_differential_privacy_noise_does_not_grow_with_replicas"]
# What tests/distributed/test_multiworker.py held (the multiworker parity job).
MULTIWORKER = [STRATEGY_PARITY, f"{PARITY}::test_matches_stock_keras_on_one_device",
               f"{PARITY}::test_keras_fit_fails_in_its_trainer_under_multiworker",
               f"{AGREEMENT}::test_processes_hold_identical_weights",
               f"{AGREEMENT}::test_inf_on_one_replica_or_process_is_skipped_by_all",
               f"{WRAPPER_PARITY}::test_accumulation_matches_one_device_with_one_aggregation_per_update"]
HOROVOD_PARITY = STRATEGY_PARITY
HOROVOD_ONE_ALLREDUCE = f"{ONE_AGGREGATION_FILE}::test_exactly_one_collective_per_step"
DP_NOISE = f"{WRAPPER_PARITY}::test_differential_privacy_noise_does_not_grow_with_replicas"
DP_PARITY = f"{WRAPPER_PARITY}::test_differential_privacy_matches_single_device"
# What tests/distributed/test_mirrored_inprocess.py held (MirroredStrategy in the test process).
MIRRORED_INPROCESS = [
    f"{D}/test_guarded_update.py",
    *(f"{AGREEMENT}::{t}" for t in ("test_nonfinite_on_one_replica_is_skipped_by_all",
                                    "test_loss_scaling_with_mixed_precision_fit_keeps_replicas_identical",
                                    "test_consistency_check_passes_in_sync_and_catches_a_planted_divergence",
                                    "test_consistency_check_catches_gradients_that_differ_at_that_step",
                                    "test_distribute_helpers_across_two_replicas",
                                    "test_run_if_check_refuses_a_condition_that_differs_across_replicas")),
    *(f"{AGREEMENT}::test_inf_on_one_replica_or_process_is_skipped_by_all[mirrored-{f}-{bad}]"
      for f in ("eager", "traced") for bad in (0, 1)),
    *(f"{WRAPPER_PARITY}::test_accumulation_matches_one_device_with_one_aggregation_per_update[mirrored-{m}-{k}]"
      for m in ("fit", "eager") for k in (1, 2, 4)),
    f"{D}/test_resume.py::test_accumulation_resumes_exactly[mirrored]",
    f"{PARITY}::test_embedding_sparse_gradients_match_single_device[mirrored-sparse]",
    f"{PARITY}::test_mixed_dtype_variables_are_aggregated_and_match_single_device",
    f"{D}/test_refused_with_the_fix.py::test_xla_fit_is_refused_with_the_fix_and_integrate_turns_it_off[mirrored]",
    f"{ONE_AGGREGATION_FILE}::test_horovod_backend_inside_a_strategy_is_refused"]
MIRRORED_PERDEVICE = "tests/unit/test_compat_canaries.py::test_keras_apply_on_device_makes_the_writes_of_keras_apply"
# The in-process tests of test_one_aggregation.py (its job-reading tests are named above).
ONE_AGGREGATION = [f"{ONE_AGGREGATION_FILE}::{t}" for t in (
    "test_multioptimizer_in_the_full_wrapper_stack_matches_one_device", "test_multioptimizer_alone_matches_one_device",
    "test_every_reachable_keras_optimizer_is_neutralised", "test_an_update_rule_that_aggregates_again_is_refused",
    "test_a_step_hook_that_synchronises_is_refused_naming_it", "test_a_stage_that_aggregates_again_is_refused",
    "test_an_aggregator_that_breaks_its_plan_is_refused", "test_mixed_dtypes_plan_one_all_reduce_per_dtype")]
EVERY_RULE = "tests/distributed/test_keras_parity.py::test_every_keras_rule_matches_one_device"


def tests(*groups) -> list[str]:
    """The test ids of `groups` (ids, or lists of ids), each once, in order."""
    out: list[str] = []
    for g in groups:
        for t in ([g] if isinstance(g, str) else g):
            if t not in out:
                out.append(t)
    return out

@dataclass
class Mutation:
    name: str
    what: str
    path: str
    old: str | tuple[str, ...]  # one text, or several (each changed to the matching `new`)
    new: str | tuple[str, ...]
    tests: list[str]

    def edits(self) -> list[tuple[str, str]]:
        if isinstance(self.old, tuple):
            return list(zip(self.old, self.new))
        return [(self.old, self.new)]


MUTATIONS = [
    Mutation("strategy-mean", "strategy backend reduces with MEAN instead of SUM",
             "dist_minimize/aggregation/strategy.py",
             "out = ctx.all_reduce(tf.distribute.ReduceOp.SUM,", "out = ctx.all_reduce(tf.distribute.ReduceOp.MEAN,",
             tests(MIRRORED, MULTIWORKER)),
    Mutation("horovod-sum", "Horovod backend uses Sum instead of Average",
             "dist_minimize/aggregation/horovod.py",
             '            kwargs["op"] = hvd.Average', '            kwargs["op"] = hvd.Sum',
             [HOROVOD_PARITY]),
    Mutation("aggregate-twice", "the optimizer runs aggregate_gradients twice per step",
             "dist_minimize/staged.py",
             '                aggregated = top.aggregate_gradients(list(grads_and_vars))\n',
             '                aggregated = top.aggregate_gradients(list(grads_and_vars))\n'
             '                aggregated = top.aggregate_gradients(list(aggregated))\n',
             tests(MIRRORED, MULTIWORKER, HOROVOD_PARITY, HOROVOD_ONE_ALLREDUCE)),
    Mutation("keras-all-reduce-kept", "the inner Keras optimizer's own all-reduce is left on (two aggregations)",
             "dist_minimize/_compat/__init__.py",
             "    optimizer._all_reduce_sum_gradients = _identity_grads_and_vars",
             "    pass",
             tests(MIRRORED, MULTIWORKER)),
    Mutation("strategy-reduce-twice", "the strategy backend all-reduces the gradients twice",
             "dist_minimize/aggregation/strategy.py",
             "            for i, r in zip(indices, out):\n",
             "            out = ctx.all_reduce(tf.distribute.ReduceOp.SUM, out, options=self.options)\n"
             "            for i, r in zip(indices, out):\n",
             tests(MIRRORED, MULTIWORKER)),
    Mutation("horovod-reduce-twice", "the Horovod backend runs its grouped allreduce twice",
             "dist_minimize/aggregation/horovod.py",
             "            reduced_buffers = hvd.grouped_allreduce(buffers, **self._allreduce_kwargs(size))\n",
             "            reduced_buffers = hvd.grouped_allreduce(buffers, **self._allreduce_kwargs(size))\n"
             "            reduced_buffers = hvd.grouped_allreduce(list(reduced_buffers), **self._allreduce_kwargs(size))\n",
             [HOROVOD_PARITY, HOROVOD_ONE_ALLREDUCE,
              f"{BACKEND_OPTIONS}::test_sum_reduction_with_global_batch_loss"]),
    Mutation("horovod-unpack-inputs", "the Horovod backend cuts its packed buffers back from the inputs, not the reduced",
             "dist_minimize/aggregation/horovod.py",
             "            out = packing.unpack(reduced_buffers, spec)\n",
             "            out = packing.unpack(buffers, spec)\n",
             [HOROVOD_PARITY, f"{BACKEND_OPTIONS}::test_packed_and_unpacked_aggregation_agree"]),
    Mutation("pack-misplaces", "packing puts the cut-back tensors in the wrong positions",
             "dist_minimize/aggregation/packing.py",
             "        for i, piece in zip(group, pieces):\n",
             "        for i, piece in zip(group[::-1], pieces):\n",
             ["tests/unit/test_packing.py", HOROVOD_PARITY]),
    Mutation("pack-below-ignored", "packing packs a tensor of `alone_from` bytes or more (the Horovod backend's pack_below)",
             "dist_minimize/aggregation/packing.py",
             "    limit = bytes_per_pack if alone_from is None else min(bytes_per_pack, alone_from)\n",
             "    limit = bytes_per_pack\n",
             ["tests/unit/test_packing.py"]),
    Mutation("predivide-no-postscale", "gradient_predivide_factor: the post-scaling is dropped",
             "dist_minimize/aggregation/horovod.py",
             '            kwargs["postscale_factor"] = self.gradient_predivide_factor / size\n', "",
             [f"{BACKEND_OPTIONS}::test_predivide_factor_keeps_the_average"]),
    Mutation("predivide-no-prescale", "gradient_predivide_factor: the pre-scaling is dropped",
             "dist_minimize/aggregation/horovod.py",
             '            kwargs["prescale_factor"] = 1.0 / self.gradient_predivide_factor\n', "",
             [f"{BACKEND_OPTIONS}::test_predivide_factor_keeps_the_average"]),
    Mutation("fp16-skipped", "compression='fp16' silently sends float32",
             "dist_minimize/aggregation/horovod.py",
             'hvd.Compression.fp16 if self.compression == "fp16" else hvd.Compression.none',
             "hvd.Compression.none",
             [f"{BACKEND_OPTIONS}::test_fp16_compression_within_its_bound_and_not_skipped"]),
    Mutation("clip-before-aggregation", "transform_gradients (the clipper) runs before aggregation",
             "dist_minimize/staged.py",
             ("            if aggregate:  # a sharded step's aggregation returns this process's share of the pairs\n",
              '                grads_and_vars = sharded_state.take_share(top, grads_and_vars)\n'
              '            grads_and_vars = top._run_stage("transform_gradients", top.transform_gradients, grads_and_vars)\n'),
             ('            grads_and_vars = top._run_stage("transform_gradients", top.transform_gradients, grads_and_vars)\n'
              "            if aggregate:  # a sharded step's aggregation returns this process's share of the pairs\n",
              '                grads_and_vars = sharded_state.take_share(top, grads_and_vars)\n'),
             tests(MIRRORED, MULTIWORKER, HOROVOD_PARITY)),
    Mutation("dp-noise-before-aggregation", "DifferentialPrivacy adds its noise on each replica before aggregation",
             "dist_minimize/wrappers/dp_sgd.py",
             ('    def transform_gradients(self, grads_and_vars):\n        """Adds the noise, once,',
              "        return super().transform_gradients(grads_and_vars)\n\n    def _add_noise"),
             ('    def transform_unaggregated_gradients(self, grads_and_vars):\n        """Adds the noise, once,',
              "        return super().transform_unaggregated_gradients(grads_and_vars)\n\n    def _add_noise"),
             [DP_NOISE]),  # (every strategy's: MirroredStrategy 2 and 4, Horovod)
    Mutation("dp-noise-local-count", "the noise is divided by the local, not the global, number of microbatches",
             "dist_minimize/wrappers/dp_sgd.py",
             "        microbatches = tf.cast(count, tf.float32) * float(distribute.num_replicas())\n",
             "        microbatches = tf.cast(count, tf.float32)\n",
             [DP_NOISE]),  # (every strategy's: MirroredStrategy 2 and 4, Horovod)
    Mutation("dp-gradient-local-count", "the clipped sum is divided by the local, not the global, number of microbatches",
             "dist_minimize/wrappers/dp_sgd.py",
             "        divisor = tf.cast(self._step.microbatches, tf.float32) * float(distribute.strategy_replicas())\n",
             "        divisor = tf.cast(self._step.microbatches, tf.float32)\n",
             [DP_PARITY]),  # (MirroredStrategy 2 and 4, Horovod)
    Mutation("dp-noise-per-replica-seed", "each replica draws its own noise (the replica id folded into the seed)",
             "dist_minimize/wrappers/dp_sgd.py",
             "seed=tf.random.experimental.stateless_fold_in(seed, i),",
             "seed=tf.random.experimental.stateless_fold_in(seed, i + 1000 * "
             "tf.distribute.get_replica_context().replica_id_in_sync_group),",
             [DP_NOISE, DP_PARITY]),
    Mutation("dp-draws-not-advanced", "the noise draw counter is not advanced (the same noise every step)",
             "dist_minimize/wrappers/dp_sgd.py",
             "        distribute.assign_replicated(self._noise_draws, tf.convert_to_tensor(self._noise_draws) + 1)\n",
             "",
             ["tests/unit/test_dp_sgd.py", DP_NOISE]),
    Mutation("exit-worker-noop", "cluster.exit_worker returns at once (no barrier, no ordered exit)",
             "dist_minimize/cluster.py",
             "    info = _from_tf_config(os.environ)\n    if info is not None and info.size > 1:\n",
             "    return\n    info = _from_tf_config(os.environ)\n    if info is not None and info.size > 1:\n",
             ["tests/distributed/test_main_job.py"]),
    Mutation("supervisor-leaves-workers", "the launcher does not stop the job when an exception ends its wait",
             "dist_minimize/launcher.py",
             ("    except BaseException:\n        _stop(procs, tree)\n        raise\n",
              "    except BaseException:\n        _stop(procs)\n        raise\n"),
             ("    except BaseException:\n        raise\n", "    except BaseException:\n        raise\n"),
             [f"{LIFECYCLE}::test_no_worker_survives_an_exception_in_the_supervisor"]),
    Mutation("rendezvous-every-interface", "a local horovodrun's rendezvous server binds every interface",
             "dist_minimize/launch/horovod_runner.py",
             "return server_factory((LOOPBACK, port)), port", 'return server_factory(("", port)), port',
             [f"{SECURITY}[horovod-gloo]",
              "tests/unit/test_compat_canaries.py::"
              "test_horovodrun_servers_bind_through_find_port_and_the_runner_moves_them_to_loopback"]),
    Mutation("local-mpi-over-tcp", "a local mpirun job keeps Open MPI's TCP transport (it listens on every interface)",
             "dist_minimize/launch/plan.py",
             'LOCAL_MPI_TRANSPORT = (("pml", "ob1"), ("btl", "self,vader"))',
             'LOCAL_MPI_TRANSPORT = (("pml", "ob1"), ("btl", "self,vader,tcp"))',
             [f"{SECURITY}[mpirun]", "tests/unit/test_launcher_cluster.py::test_local_plans_bind_loopback"]),
    Mutation("per-device-no-weight-decay", "the per-device guarded update leaves out Keras's weight decay",
             "dist_minimize/_compat/per_device.py",
             "        if optimizer.weight_decay is not None:\n            for variable in local:",
             "        if False:\n            for variable in local:",
             [MIRRORED_PERDEVICE, STRATEGY_PARITY]),
    Mutation("per-device-no-iterations", "the per-device guarded update does not count the iteration",
             "dist_minimize/_compat/per_device.py",
             "    strategy.experimental_local_results(optimizer.iterations.value)[index].assign_add(1)",
             "    pass",
             tests(MIRRORED_PERDEVICE, MIRRORED_INPROCESS)),
    Mutation("per-device-ignores-guard", "the per-device update is made whether or not the step is finite",
             "dist_minimize/distribute.py",
             "                _compat.unlowered_cond(agreed, ",
             "                _compat.unlowered_cond(tf.constant(True), ",
             MIRRORED_INPROCESS),
    Mutation("per-device-first-device-only", "every device's update is made on the first device's copies",
             "dist_minimize/distribute.py",
             "            with tf.device(device), _compat.update_context(i):",
             "            with tf.device(device), _compat.update_context(0):",
             tests(MIRRORED_INPROCESS, STRATEGY_PARITY)),
    Mutation("per-device-skip-uncounted", "a step the per-device update skips is not counted in skipped_steps",
             "dist_minimize/distribute.py",
             "lambda: _discard(otherwise(i)))",
             "lambda: None)",
             MIRRORED_INPROCESS),
    Mutation("per-device-any-resource", "a device's cond is kept whole though it reads a resource of another device",
             "dist_minimize/_compat/per_device.py",
             "    if not first.device_type or any(not _same_device(d, first) for d in devices[1:]):\n        return None",
             "    if not first.device_type:\n        return None",
             [f"{D}/test_guarded_update.py",
              "tests/unit/test_compat_canaries.py::test_unlowered_cond_stays_lowered_on_resources_of_two_devices"]),
    Mutation("unlowered-away-from-resources", "an If is kept whole on another device than its resources",
             "dist_minimize/_compat/per_device.py",
             "    if op.device and not _same_device(tf.DeviceSpec.from_string(op.device), first):\n        return None",
             "    if False:\n        return None",
             ["tests/unit/test_compat_canaries.py::test_unlowered_cond_stays_lowered_when_placed_away_from_its_resources"]),
    Mutation("unlowered-without-kernels", "an If is kept whole though an op of its branches has no kernel for the device",
             "dist_minimize/_compat/per_device.py",
             "    if device is None or ops_without_kernel(made[0], device.device_type):",
             "    if device is None:",
             ["tests/unit/test_compat_canaries.py::test_unlowered_cond_stays_lowered_when_a_branch_op_has_no_kernel_for_the_device",
              f"{D}/test_guarded_update.py::test_devices_without_a_kernel_for_an_update_op_keep_their_cond_lowered"]),
    Mutation("single-device-cond-lowered", "the guarded update on one device (Horovod, no strategy) is a lowered cond",
             "dist_minimize/distribute.py",
             "    _compat.unlowered_cond(condition, lambda: _discard(fn(*args)), lambda: _discard(otherwise()))",
             "    tf.cond(condition, lambda: _discard(fn(*args)), lambda: _discard(otherwise()))",
             ["tests/unit/test_optimizer.py::test_guarded_update_without_a_strategy_is_one_unlowered_if"]),
    Mutation("period-before-start", "a periodic schedule fires before its start (SWA before start_averaging)",
             "dist_minimize/wrappers/_periodic.py",
             "    return tf.logical_and(t >= 0, tf.equal(t // period * period, t))",
             "    return tf.equal(t // period * period, t)",
             ["tests/unit/test_periodic.py::test_on_period_is_the_modulo_schedule_from_start"]),
    Mutation("per-device-central-storage", "variables with one copy for all devices are updated device by device",
             "dist_minimize/_per_device.py",
             "    if distribute.uses_merge_call() and not distribute.has_copy_per_device(",
             "    if False and not distribute.has_copy_per_device(",
             MIRRORED_INPROCESS),
    # Issue 22: the behaviours ported from TF Addons and TF Privacy.
    Mutation("ma-dynamic-count-from-one", "MovingAverage's dynamic decay counts the current update (2/11 at the first, not 0.1)",
             "dist_minimize/wrappers/moving_average.py",
             "            d = tf.minimum(d, (1.0 + c) / (10.0 + c))\n",
             "            d = tf.minimum(d, (2.0 + c) / (11.0 + c))\n",
             ["tests/unit/test_ported_semantics.py::test_moving_average_dynamic_decay_is_tf_addons_worked_example",
              "tests/unit/test_ported_semantics.py::test_moving_average_matches_tf_addons_rule_over_steps"]),
    Mutation("ma-num-updates-ignored", "MovingAverage's num_updates does not cap the decay",
             "dist_minimize/wrappers/moving_average.py",
             "            d = tf.minimum(d, (1.0 + n) / (10.0 + n))\n",
             "            d = d\n",
             ["tests/unit/test_ported_semantics.py::test_moving_average_matches_tf_addons_rule_over_steps",
              "tests/unit/test_ported_semantics.py::test_moving_average_num_updates_variable_is_read_at_each_update"]),
    Mutation("assign-average-vars-raises", "assign_average_vars raises on a variable without an average (BN statistics)",
             "dist_minimize/wrappers/averaging.py",
             "                skipped.append(v)\n                continue\n",
             "                raise ValueError(f\"{variable_name(v)} is not averaged\")\n",
             ["tests/unit/test_ported_semantics.py::test_assign_average_vars_skips_batch_norm_statistics_with_one_warning"]),
    Mutation("wd-zero-arg-gets-count", "DecoupledWeightDecay calls a zero-argument weight_decay with the update count",
             "dist_minimize/wrappers/weight_decay.py",
             "            value = wd(self.iterations) if _takes_the_count(wd) else wd()\n",
             "            value = wd(self.iterations)\n",
             ["tests/unit/test_ported_semantics.py::test_decoupled_weight_decay_forms_match_numpy"]),
    Mutation("wd-property-reads-rule", "DecoupledWeightDecay.weight_decay reads the Keras update rule's setting",
             "dist_minimize/wrappers/weight_decay.py",
             '        return self.__dict__.get("weight_decay_value")\n',
             "        return super().weight_decay\n",
             ["tests/unit/test_ported_semantics.py::test_decoupled_weight_decay_property_is_its_own_setting"]),
    Mutation("dp-trailing-axes-summed", "DifferentialPrivacy sums a per-example loss's trailing axes instead of averaging",
             "dist_minimize/wrappers/dp_sgd.py",
             "            loss = tf.reduce_mean(loss, axis=list(range(1, loss.shape.rank)))\n",
             "            loss = tf.reduce_sum(loss, axis=list(range(1, loss.shape.rank)))\n",
             ["tests/unit/test_ported_semantics.py::test_dp_per_example_loss_with_trailing_axis_is_reduced_by_its_mean",
              "tests/unit/test_ported_semantics.py::test_dp_per_example_loss_with_trailing_axis_under_mirrored_strategy"]),
    # Issue 22: exactly one aggregation, by construction and checked.
    Mutation("sub-optimizer-not-neutralised", "only the wrapped Keras optimizer's all-reduce is switched off, "
             "not its sub-optimizers' (MultiOptimizer aggregated twice)",
             "dist_minimize/aggregation/exactly_once.py",
             "    found = keras_optimizers(root)\n", "    found = [root]\n",
             tests(ONE_AGGREGATION, EVERY_RULE)),
    Mutation("update-rule-collective-allowed", "a collective inside the update rule is not refused",
             "dist_minimize/step/zones.py",
             "    if zone.forbid:\n", "    if False:\n",
             ONE_AGGREGATION),
    Mutation("aggregator-plan-unchecked", "an aggregator that makes more collectives than it plans is not refused",
             "dist_minimize/aggregation/exactly_once.py",
             "    if plan is not None and len(zone.events) != plan:\n", "    if False:\n",
             ONE_AGGREGATION),
    Mutation("second-aggregation-allowed", "aggregate_gradients may run twice in one step",
             "dist_minimize/aggregation/exactly_once.py",
             "    if len(CONTEXT.aggregations) > allowed:\n", "    if len(CONTEXT.aggregations) > allowed + 1:\n",
             tests(ONE_AGGREGATION, "tests/unit/test_sam.py::test_an_extra_aggregation_counts_only_when_declared")),
    # Issue 23 (a layered package): what replaced imports of subclasses.
    Mutation("refuses-outside-ignored", "a wrapper's `refuses_outside` declaration is not read "
             "(accumulation or loss scaling around DifferentialPrivacy accepted)",
             "dist_minimize/wrappers/base.py",
             "                if name in mine:\n", "                if False:\n",
             ["tests/unit/test_dp_sgd.py::test_wrappers_around_it_are_refused"]),
    Mutation("keras-settings-unanswered", "the stack's `keras_settings()` answers are ignored (Keras's defaults read back)",
             "dist_minimize/_keras_surface.py",
             "            if setting in values:\n", "            if False:\n",
             ["tests/unit/test_keras_dropin.py"]),
    Mutation("per-replica-setting-accepted", "a per-replica Keras setting set on a dist_minimize optimizer is not "
             "refused with what to use instead",
             "dist_minimize/_keras_surface.py",
             "        if setting in _PER_REPLICA_SETTINGS and value:\n", "        if False:\n",
             ["tests/unit/test_keras_dropin.py::test_setting_a_per_replica_keras_setting_is_refused_naming_what_to_use"]),
    Mutation("keras-loss-scale-wrapping-accepted", "Keras's LossScaleOptimizer may wrap a dist_minimize optimizer",
             "dist_minimize/_keras_surface.py",
             '        if name == "loss_scale_factor" and getattr(self, "_dm_constructed", False):\n', "        if False:\n",
             ["tests/unit/test_wrappers.py::test_keras_auto_loss_scale_wrapping_is_refused"]),
    Mutation("compression-residual-not-added-back", "compressed aggregation drops its residual instead of sending it "
             "with the next step's gradient",
             "dist_minimize/wrappers/compression.py",
             "            x = g + tf.cast(residual, g.dtype)\n", "            x = g\n",
             ["tests/unit/test_compression.py::test_applied_plus_residual_is_the_exact_gradient_at_every_step"]),
    Mutation("compression-fp16-unclipped", "float16 compression sends values beyond float16's range (inf)",
             "dist_minimize/wrappers/compression.py",
             "tf.clip_by_value(x, -bound, bound), x)", "x, x)",
             ["tests/unit/test_compression.py::test_a_float16_overflow_is_clipped_and_the_rest_sent_later"]),
    Mutation("compression-residual-kept-on-skip", "a skipped step still changes the residuals",
             "dist_minimize/wrappers/compression.py",
             "tf.where(finite, tf.cast(new, residual.dtype), residual)", "tf.cast(new, residual.dtype)",
             ["tests/unit/test_compression.py::test_a_non_finite_step_is_skipped_and_leaves_the_residual"]),
    Mutation("compression-residual-not-shared", "under Horovod a checkpoint keeps rank 0's residuals only "
             "(share_process_state does nothing)",
             "dist_minimize/wrappers/compression.py",
             "            residual.assign(mean)\n", "            residual.assign(residual)\n",
             ["tests/distributed/test_compression.py::"
              "test_a_checkpoint_evens_the_residuals_out_without_changing_their_average"]),
    Mutation("low-rank-residual-dropped", "low-rank compression keeps nothing of what it did not send",
             "dist_minimize/wrappers/compression.py",
             "            kept = m - tf.matmul(basis, tf.matmul(basis, m, transpose_a=True))\n",
             "            kept = tf.zeros_like(m)\n",
             ["tests/unit/test_compression.py::test_low_rank_applied_plus_residual_is_the_exact_gradient"]),
    Mutation("low-rank-q-not-kept", "low-rank compression starts every update from its first Q (no warm start)",
             "dist_minimize/wrappers/compression.py",
             "            distribute.assign_replicated(q, tf.where(finite, q_sum, q))",
             "            tf.no_op()",
             ["tests/unit/test_compression.py::test_a_gradient_of_the_rank_is_sent_whole_and_q_is_kept"]),
    Mutation("low-rank-q-written-on-skip", "a skipped step still changes the low-rank Q",
             "dist_minimize/wrappers/compression.py",
             "tf.where(finite, q_sum, q)", "q_sum",
             ["tests/unit/test_compression.py::test_low_rank_skips_a_non_finite_step_and_resumes_exactly"]),
    Mutation("stage2-aggregated-twice", "with sharded accumulators the window's accumulated share is "
             "reduce-scattered again at the update (aggregated twice)",
             "dist_minimize/wrappers/accumulation.py",
             "aggregate=aggregate and not sharded)", "aggregate=aggregate)",
             ["tests/distributed/test_sharded_state.py::"
              "test_sharded_matches_unsharded[horovod-gloo-2-adam/callable/some/accumulate_sharded]"]),
    Mutation("saved-state-misordered", "an optimizer's saved variables are restored in another order",
             "dist_minimize/_keras_surface.py",
             "            variable.assign(store[str(i)])\n", "            variable.assign(store[str(len(own) - 1 - i)])\n",
             ["tests/unit/test_compatibility.py"]),
    Mutation("step-hook-unchecked", "a step hook's collective is not refused (the update contract unenforced)",
             "dist_minimize/staged.py",
             '            with exactly_once.step_hook(opt, "on_applied"):\n', "            with contextlib.nullcontext():\n",
             [f"{ONE_AGGREGATION_FILE}::test_a_step_hook_that_synchronises_is_refused_naming_it"]),
    Mutation("sum-across-one-all-reduce", "dist_minimize.distribute.sum_across packs values of several dtypes into one all-reduce",
             "dist_minimize/distribute.py",
             "            by_dtype.setdefault(v.dtype, []).append(i)\n", "            by_dtype.setdefault(0, []).append(i)\n",
             ["tests/unit/test_distribute.py::test_sum_and_mean_across_replicas"]),
    Mutation("run-if-branch-results-kept", "run_if's branches return fn's result (branches of unequal outputs fail)",
             "dist_minimize/distribute.py",
             "    _compat.unlowered_cond(condition, lambda: _discard(fn(*args)), lambda: _discard(otherwise()))\n",
             "    _compat.unlowered_cond(condition, lambda: fn(*args), otherwise)\n",
             ["tests/unit/test_distribute.py::test_run_if_without_a_strategy_eager_and_traced"]),
    Mutation("replicated-from-first-device", "assign_replicated copies the first replica's value to every device",
             "dist_minimize/distribute.py",
             "        if has_copy_per_device([target]):\n", "        if False:\n",
             ["tests/unit/test_distribute.py::test_assign_replicated_writes_each_copy_from_its_own_replica"]),
    Mutation("update-inputs-in-branch", "the Keras rule reads its step counter inside the guard's branch",
             "dist_minimize/_per_device.py",
             "grads, inputs = [g for g, _ in grads_and_vars], _compat.keras_update_inputs(rule)",
             "grads, inputs = [g for g, _ in grads_and_vars], None",
             ["tests/distributed/test_guarded_update.py::test_the_rule_reads_its_step_counter_before_the_branch"]),
    Mutation("deferred-scale-dropped", "the guard takes the clipper's unscaled gradients and forgets the factor",
             "dist_minimize/_per_device.py",
             "        if factor is not None:\n", "        if False:\n",
             ["tests/distributed/test_guarded_update.py::test_the_clippers_products_are_made_in_the_branch"]),
    Mutation("deferred-scale-twice", "the guard scales the clipper's products again in its branch",
             "dist_minimize/_per_device.py",
             "    grads, factor = scaled or (grads, None)",
             "    factor = (scaled or (grads, None))[1]",
             ["tests/distributed/test_guarded_update.py::test_the_clippers_products_are_made_in_the_branch"]),
    Mutation("held-back-write-lost", "a rule's own write that the StatelessScope held back is not made",
             "dist_minimize/_compat/per_device.py",
             "            strategy.experimental_local_results(variable.value)[index].assign(value)\n",
             "            pass\n",
             ["tests/unit/test_compat_canaries.py::test_a_rules_direct_write_held_back_by_the_scope_is_made"]),
    Mutation("focused-first-copy-only", "a focused benchmark comparison reads only the first build of each side",
             "benchmarks/_timing.py",
             "statistics.fmean(turn) for turn in", "turn[0] for turn in",
             ["tests/tooling/test_benchmarks.py::test_a_focused_comparison_averages_each_side_over_its_builds"]),
    Mutation("strategy-plan-one", "the strategy backend plans one all-reduce whatever the dtypes",
             "dist_minimize/aggregation/strategy.py",
             "        return len({g.dtype for g, _ in grads_and_vars if g is not None})\n", "        return 1\n",
             ONE_AGGREGATION),
    # Issue 22 (A-E): Keras settings validated, gradient forms converted, clip bounds
    # settable between steps, lazy build under MirroredStrategy, strategy limits named.
    Mutation("keras-clip-setting-unchecked", "an invalid Keras clip setting (<= 0, NaN, inf) is not checked in Keras style",
             "dist_minimize/_keras_settings.py",
             "        check_setting(setting, value, name)\n        t.disable[setting] = None\n",
             "        t.disable[setting] = None\n",
             ["tests/unit/test_keras_settings_validation.py::test_an_invalid_translated_setting_is_refused_in_keras_style"]),
    Mutation("gradient-lists-not-converted", "gradients given as lists, NumPy arrays or numbers are passed on unconverted",
             "dist_minimize/step/stages.py",
             "        pairs = [(as_gradient(g, v), v) for g, v in pairs]\n",
             "        pairs = [(g, v) for g, v in pairs]\n",
             ["tests/unit/test_gradient_forms.py"]),
    Mutation("clip-setter-ignored", "`opt.clipnorm = v` on a stack with that clipper keeps the old bound",
             "dist_minimize/_keras_settings.py",
             "        setattr(found[0], attribute, value)\n",
             "        pass\n",
             ["tests/unit/test_keras_settings_validation.py::"
              "test_a_clip_set_between_steps_of_a_traced_loop_applies_from_the_next_step"]),
    Mutation("clip-bound-baked-into-trace", "a built clipper uses its bound as a constant of the trace, not its variable",
             "dist_minimize/transforms/clipping.py",
             "        if self._bound_variable is not None:\n"
             "            return tf.cast(tf.convert_to_tensor(self._bound_variable), dtype)\n",
             "        if False:\n"
             "            return tf.cast(tf.convert_to_tensor(self._bound_variable), dtype)\n",
             ["tests/unit/test_keras_settings_validation.py::"
              "test_a_clip_set_between_steps_of_a_traced_loop_applies_from_the_next_step",
              "tests/unit/test_keras_settings_validation.py::test_a_clip_set_between_two_fits_applies_to_the_second"]),
    Mutation("lazy-build-in-trace", "a build on first use runs inside the traced step (no init_scope)",
             "dist_minimize/_slots.py",
             "        with tf.init_scope(), strategy.scope(), keras.name_scope(optimizer.name, caller=optimizer):\n",
             "        with strategy.scope(), keras.name_scope(optimizer.name, caller=optimizer):\n",
             ["tests/unit/test_lazy_build.py"]),
    Mutation("steps-per-execution-let-through", "integrate lets steps_per_execution > 1 through under MirroredStrategy on CPUs",
             "dist_minimize/fit.py",
             "    if blocker:\n        raise ValueError(blocker)\n",
             "    if False:\n        raise ValueError(blocker)\n",
             ["tests/unit/test_strategy_limits.py::test_steps_per_execution_under_mirrored_cpus_is_refused_at_integrate"]),
    Mutation("outside-scope-unchecked", "apply_gradients does not check that the variables were made in the strategy's scope",
             "dist_minimize/step/stages.py",
             "        check_variables_in_strategy([v for _, v in pairs])\n",
             "",
             ["tests/unit/test_strategy_limits.py::test_a_variable_created_outside_the_scope_is_named_with_the_fix"]),
    # Issue 24: SAM and the public form it is written with.
    Mutation("sam-local-perturbation", "SAM perturbs along each replica's own gradient by default (not the aggregated one)",
             "dist_minimize/wrappers/sam.py",
             "        if not self.per_replica and first:\n",
             "        if False and first:\n",
             ["tests/distributed/test_sam_parity.py::test_sam_on_two_replicas_matches_one_device",
              "tests/distributed/test_sam_parity.py::test_sam_on_two_processes_matches_one_device"]),
    Mutation("sam-not-restored", "SAM leaves the weights perturbed when the update is applied",
             "dist_minimize/wrappers/sam.py",
             "            distribute.assign_local([(v, w) for v, w, _ in perturbed])\n",
             "            pass\n",
             ["tests/unit/test_sam.py::test_sam_matches_numpy_in_a_custom_loop"]),
    Mutation("asam-scaling-dropped", "ASAM's element-wise scaling by |w| is dropped from the perturbation",
             "dist_minimize/wrappers/sam.py",
             "            e = self.rho * (tf.square(w) * g if self.adaptive else g) / (norm + self.epsilon)\n",
             "            e = self.rho * g / (norm + self.epsilon)\n",
             ["tests/unit/test_sam.py::test_sam_matches_numpy_in_a_custom_loop"]),
    Mutation("loss-fn-shared-across-replicas", "the loss function is kept on the shared optimizer, so a replica may "
             "evaluate another replica's loss",
             "dist_minimize/staged.py",
             "            again = (lambda: self.transform_loss(loss_fn())) if loss_fn is not None else None\n",
             "            object.__setattr__(self, '_dm_shared_loss_fn', loss_fn)\n"
             "            again = (lambda: self.transform_loss(self._dm_shared_loss_fn())) if loss_fn is not None else None\n",
             ["tests/distributed/test_sam_parity.py::test_sam_on_two_replicas_matches_one_device"]),
    Mutation("state-on-self-allowed", "a value of one call kept on a wrapper during a step is not refused",
             "dist_minimize/_keras_surface.py",
             "        if CONTEXT.aggregations is not None and getattr(self, \"built\", False) and _per_call(value):\n",
             "        if False:\n",
             ["tests/unit/test_sam.py::test_state_kept_on_self_during_a_step_is_refused_naming_the_rule"]),
    Mutation("loss-fn-not-passed", "integrate's train step gives get_gradients no loss function",
             "dist_minimize/fit.py",
             "        model.optimizer.minimize(loss, model.trainable_variables, tape=tape, loss_fn=loss_fn)\n",
             "        model.optimizer.minimize(loss, model.trainable_variables, tape=tape)\n",
             ["tests/unit/test_sam.py::test_sam_under_fit_through_integrate_matches_numpy"]),
    Mutation("own-train-step-replaced", "integrate silently replaces a model's own train_step",
             "dist_minimize/fit.py",
             "    if own is not None:\n        raise ValueError(",
             "    if False:\n        raise ValueError(",
             ["tests/unit/test_sam.py::test_integrate_refuses_to_replace_a_users_train_step_and_that_step_works"]),
    # Issue 25: exact resume.
    Mutation("resume-retrains-seen-batches", "a resumed fit trains the interrupted epoch again from its start",
             "dist_minimize/checkpoint.py",
             "            history = self.model.fit(stream(self.step), epochs=epoch + 1, initial_epoch=epoch,\n"
             "                                     steps_per_epoch=per_epoch - batch,",
             "            history = self.model.fit(stream(epoch * per_epoch), epochs=epoch + 1, initial_epoch=epoch,\n"
             "                                     steps_per_epoch=per_epoch,",
             ["tests/unit/test_checkpoint.py::test_fit_resumes_exactly_after_a_lost_process"]),
    Mutation("input-position-not-restored", "restore reads the state but not the number of batches trained",
             "dist_minimize/checkpoint.py",
             "        self.step = self._saved = step\n",
             "        self._saved = step\n",
             ["tests/unit/test_checkpoint.py::test_fit_resumes_exactly_after_a_lost_process",
              "tests/unit/test_checkpoint.py::test_custom_loop_resumes_exactly"]),
    Mutation("save-step-not-agreed", "each worker acts on its own stop request: it saves and leaves alone",
             "dist_minimize/checkpoint.py",
             "        self.stopping = self._any_worker(self._watcher.requested())\n",
             "        self.stopping = self._watcher.requested()\n",
             ["tests/distributed/test_restarts.py::test_a_lost_worker_costs_time_not_the_result"]),
    Mutation("worker-skips-the-save", "under MultiWorkerMirroredStrategy only the chief takes part in a save",
             "dist_minimize/checkpoint.py",
             "        if not writer and distribute.horovod_size() > 1:\n",
             "        if not writer:\n",
             ["tests/distributed/test_restarts.py::test_a_lost_worker_costs_time_not_the_result"]),
    Mutation("save-inside-a-window", "a save does not wait for the end of the accumulation window",
             "dist_minimize/checkpoint.py",
             "        if self.step % self._micro:\n            return False",
             "        if False:\n            return False",
             ["tests/unit/test_checkpoint.py::test_sigterm_saves_at_the_next_boundary_and_exits_42",
              "tests/distributed/test_restarts.py::test_a_lost_worker_costs_time_not_the_result"]),
    # Issue 26: sharded optimizer state.
    Mutation("shard-update-not-owned", "each process updates the share of the next process, with its own gradients",
             "dist_minimize/aggregation/sharded.py",
             "    out = {i: None for i, owner in enumerate(owners) if owner == rank}\n",
             "    out = {i: None for i, owner in enumerate(owners) if owner == (rank + 1) % size}\n",
             [f"{SHARDED}::test_sharded_matches_unsharded[horovod-gloo-2-adam/callable/some]"]),
    Mutation("shard-clip-local-norm", "a sharded step clips by the norm of the process's own share",
             "dist_minimize/transforms/clipping.py",
             "    everyones = CONTEXT.everyones_values(halves)\n",
             "    everyones = None\n",
             [f"{SHARDED}::test_sharded_matches_unsharded[horovod-gloo-2-adam/callable/some]"]),
    Mutation("shard-allgather-skipped", "the new weights of the other shares are never gathered",
             "dist_minimize/staged.py",
             "                sharded.gather()\n",
             "                pass\n",
             [f"{SHARDED}::test_sharded_matches_unsharded[horovod-gloo-2-adam/callable/some]"]),
    Mutation("shard-local-slice", "the reduce-scatter is a local slice of the process's own, unaggregated gradients",
             "dist_minimize/aggregation/horovod.py",
             "                reduced = self._hvd.allreduce(buffer, name=f\"dm_shard_allreduce_{k}\", **kwargs)\n",
             "                reduced = buffer\n",
             [f"{SHARDED}::test_sharded_matches_unsharded[horovod-gloo-2-adam/callable/some]"]),
    Mutation("shard-local-slice-reducescatter", "with shard_collective='reducescatter', the reduce-scatter is a "
             "local slice of the process's own, unaggregated gradients",
             "dist_minimize/aggregation/horovod.py",
             "                return self._hvd.reducescatter(buffer, name=f\"dm_shard_reducescatter_{k}\", **kwargs)\n",
             "                return tf.reshape(buffer, [size, -1])[rank]\n",
             [f"{SHARDED}::test_sharded_matches_unsharded[horovod-gloo-4-adam/callable/some]"]),
    Mutation("shard-buckets-unordered", "a sharded step's buckets are not ordered (every buffer may be built "
             "before the first collective runs)",
             "dist_minimize/aggregation/sharded.py",
             "    return tf.control_dependencies(done[-1:])\n",
             "    return tf.control_dependencies([])\n",
             ["tests/unit/test_sharding.py::test_buckets_go_in_order_so_only_one_buffer_lives_at_once"]),
    Mutation("shard-segment-view", "the segment a process keeps from a bucket's all-reduce is a slice (a view "
             "that holds the whole reduced buffer until the update has run)",
             "dist_minimize/aggregation/sharded.py",
             "    return segment if distribute.in_xla() else tf.raw_ops.DeepCopy(x=segment)\n",
             "    return segment\n",
             ["tests/unit/test_sharding.py::test_a_segment_kept_from_an_all_reduce_is_a_copy_not_a_view"]),
    Mutation("shard-collective-auto-reducescatter", "shard_collective='auto' takes Horovod's reduce-scatter on CPUs",
             "dist_minimize/aggregation/horovod.py",
             "        return \"reducescatter\" if tf.config.list_logical_devices(\"GPU\") else \"allreduce\"\n",
             "        return \"reducescatter\"\n",
             [f"{SHARDED}::test_each_job_takes_its_collective[horovod-gloo-2]"]),
    Mutation("shard-mw-slots-mirrored", "under MultiWorkerMirroredStrategy a share's slots are made by the "
             "strategy (mirrored, their initial values broadcast: the workers' broadcasts do not pair)",
             "dist_minimize/sharding/sharded_state.py",
             "            return _compat.local_variables()\n",
             "            return contextlib.nullcontext()\n",
             [f"{SHARDED}::test_sharded_matches_unsharded[multiworker-2-adam/callable/some]"]),
    Mutation("shard-mw-rank-zero", "every MultiWorkerMirroredStrategy worker takes itself for worker 0",
             "dist_minimize/aggregation/strategy.py",
             "    return resolver.task_id + (1 if spec.get(\"chief\") else 0)\n",
             "    return 0\n",
             [f"{SHARDED}::test_sharded_matches_unsharded[multiworker-2-adam/callable/some]"]),
    Mutation("shard-ckpt-mw-no-exchange", "MultiWorkerMirroredStrategy workers write a sharded checkpoint without "
             "exchanging what each holds",
             "dist_minimize/sharding/sharded_checkpoint.py",
             "    if sharding is None or sharding.size == 1:\n",
             "    if True:\n",
             [f"{SHARDED}::test_sharded_checkpoint_resumes_on_any_number_of_processes[multiworker-2-to-2]"]),
    Mutation("shard-averages-not-gathered", "assign_average_vars writes this process's averages only (the "
             "others' variables keep their weights)",
             "dist_minimize/wrappers/averaging.py",
             "        sharded_state.gather_shares(self)  # sharded: every process's averages, everywhere\n",
             "",
             [f"{SHARDED}::test_sharded_matches_unsharded[horovod-gloo-2-adam/callable/some/average]"]),
    Mutation("shard-dp-noise-by-share-position", "DP noise seeded by a pair's place in the process's share, not "
             "in the whole step",
             "dist_minimize/wrappers/dp_sgd.py",
             "        for i, (g, v) in zip(CONTEXT.positions(len(grads_and_vars)), grads_and_vars):\n",
             "        for i, (g, v) in enumerate(grads_and_vars):\n",
             [f"{SHARDED}::test_sharded_matches_unsharded[horovod-gloo-2-sgd/fit_integrated/some/dp_noise]"]),
    Mutation("shard-accumulators-of-the-share", "GradientAccumulation builds accumulators for the process's "
             "share only (the gradients of the others' variables, summed before the reduce-scatter, are lost)",
             "dist_minimize/wrappers/accumulation.py",
             "        for v in var_list if sharded else self.trained_variables:\n",
             "        for v in var_list:\n",
             [f"{SHARDED}::test_sharded_matches_unsharded[multiworker-2-adam/callable/some/accumulate]"]),
    Mutation("shard-ckpt-own-file-only", "a restore reads one file of a sharded checkpoint (its other "
             "processes' shares are lost)",
             "dist_minimize/sharding/sharded_checkpoint.py",
             "    for file, state in sorted(by_file.items()):\n",
             "    for file, state in sorted(by_file.items())[:1]:\n",
             [f"{SHARDED}::test_sharded_checkpoint_resumes_on_any_number_of_processes[2-to-4]"]),
    Mutation("shard-ckpt-rank0-only", "only rank 0 writes its share of a sharded checkpoint",
             "dist_minimize/sharding/sharded_checkpoint.py",
             "    held = collect(paths)",
             "    held = collect([] if rank else paths)",
             [f"{SHARDED}::test_sharded_checkpoint_resumes_on_any_number_of_processes[2-to-2]"]),
    Mutation("no-restart", "the launcher ignores max_restarts",
             "dist_minimize/launcher.py",
             "    for attempt in range(max_restarts + 1):\n",
             "    for attempt in range(1):\n",
             ["tests/unit/test_launcher_restarts.py::test_max_restarts_starts_the_whole_job_again"]),
    Mutation("all-reduce-hook-kept", "the wrapper of ReplicaContextBase.all_reduce stays after dist_minimize's step",
             "dist_minimize/_compat/__init__.py",
             '                if base.__dict__.get("all_reduce") is _Hearing.wrapper:',
             "                if False:",
             ["tests/unit/test_isolation.py::test_a_dist_minimize_step_changes_no_tensorflow_or_keras_attribute_and_no_stock_result",
              "tests/unit/test_compat_canaries.py::test_every_replica_context_all_reduce_is_heard_inside_and_tensorflow_is_unchanged_outside"]),
    Mutation("minimize-autograph", "minimize is converted by AutoGraph (its stages' Python with it)",
             "dist_minimize/staged.py",
             "    @tf.autograph.experimental.do_not_convert  # (see the class docstring: no AutoGraph)\n    def minimize(",
             "    def minimize(",
             ["tests/unit/test_protocol.py::test_the_stages_run_as_python_while_traced_without_autograph"]),
    Mutation("apply-gradients-autograph", "apply_gradients is converted by AutoGraph (its stages' Python with it)",
             "dist_minimize/staged.py",
             "    @tf.autograph.experimental.do_not_convert  # (see the class docstring: no AutoGraph)\n    def apply_gradients(",
             "    def apply_gradients(",
             ["tests/unit/test_protocol.py::test_the_stages_run_as_python_while_traced_without_autograph"]),
    Mutation("sharded-transform-unchecked", "an undeclared transform_gradients callable is taken with sharded state",
             "dist_minimize/optimizer.py",
             "            sharded_state.check_transforms(list(gradient_fns) + list(translation.clippers))\n",
             "            pass\n",
             ["tests/unit/test_sharding.py::test_a_transform_that_does_not_declare_shards_state_is_refused_at_construction_naming_it"]),
    Mutation("broadcast-by-name", "the broadcast matches optimizer variables by their names (paths) again",
             "dist_minimize/horovod_keras/__init__.py",
             '        held = [(f"optimizer variable {key!r}", keyed[key]) for key in sorted(keyed)\n',
             '        held = [(f"optimizer variable {keyed[key].path!r}", keyed[key]) for key in sorted(keyed)\n',
             ["tests/distributed/test_broadcast.py::test_a_loaded_model_and_a_fresh_one_end_with_every_optimizer_variable_of_the_root"]),
    Mutation("optimizer-takes-wrapper-settings", "Optimizer(...) takes use_ema & co. and drops them silently",
             "dist_minimize/optimizer.py",
             "        if translation.wrappers:\n            raise ValueError(",
             "        if False:\n            raise ValueError(",
             ["tests/unit/test_errors.py::test_bad_input_raises_clear_error"]),
    Mutation("accumulation-sum-averages", "GradientAccumulation(average=False) divides by steps anyway",
             "dist_minimize/wrappers/accumulation.py",
             "            divisor = self.steps if self.average else 1\n",
             "            divisor = self.steps\n",
             ["tests/unit/test_wrappers.py::test_accumulation_with_average_false_updates_with_the_sum_of_the_micro_steps_gradients"]),
    Mutation("momentum-correction-dropped", "the learning-rate callbacks change the rate without rescaling the momentum slots",
             "dist_minimize/horovod_keras/learning_rate.py",
             "                slot.assign(slot * tf.cast(factor, slot.dtype))\n",
             "                pass\n",
             ["tests/unit/test_learning_rate.py::test_momentum_correction_is_horovods_corrected_sgd_step"]),
    Mutation("epoch-schedule-staircase-ignored", "EpochSchedule treats a staircase callback as acting at every batch",
             "dist_minimize/horovod_keras/learning_rate.py",
             "        if c.staircase:\n            epoch = step // per\n",
             "        if False:\n            epoch = step // per\n",
             ["tests/unit/test_learning_rate.py::test_epoch_schedule_gives_the_rates_the_callbacks_set_at_every_step"]),
    Mutation("sync-bn-local-statistics", "SyncBatchNormalization uses the local batch's statistics",
             "dist_minimize/horovod_keras/sync_batch_norm.py",
             "    if distribute.horovod_size() == 1:\n        return tensor\n",
             "    if True:\n        return tensor\n",
             ["tests/distributed/test_sync_batch_norm.py::test_sync_batch_norm_on_n_ranks_is_batch_norm_on_one_device_with_the_whole_batch"]),
    Mutation("local-gradient-aggregated", "a rank-local variable's gradient is aggregated like a shared one",
             "dist_minimize/sharding/local.py",
             "        local = [self.contains(rule, v) for _, v in grads_and_vars]\n",
             "        local = [False for _, v in grads_and_vars]\n",
             ["tests/distributed/test_local_variables.py::test_local_gradients_are_each_ranks_own_scaled_and_the_clip_counts_them_all"]),
    Mutation("local-norm-own-rank", "the global norm counts this rank's local gradients only",
             "dist_minimize/sharding/local.py",
             "            step.everyones = lambda values: _with_local_sums(values, local)\n",
             "            pass\n",
             ["tests/distributed/test_local_variables.py::test_local_gradients_are_each_ranks_own_scaled_and_the_clip_counts_them_all"]),
    Mutation("local-guard-own-rank", "the non-finite guard decides from this rank's local gradients alone",
             "dist_minimize/sharding/local.py",
             '            step.sum = lambda value: distribute.sum_across(value, name="dm_local_sum")\n',
             "            pass\n",
             ["tests/distributed/test_local_variables.py::test_an_inf_in_one_ranks_local_gradient_skips_the_step_on_every_rank"]),
    Mutation("sharded-local-gradient-aggregated", "with sharded state, a rank-local variable joins the partition",
             "dist_minimize/sharding/sharded_state.py",
             "            self._local = {id(v) for v in var_list if is_local(v)}\n",
             "            self._local = set()\n",
             ["tests/distributed/test_local_variables.py::test_local_gradients_are_each_ranks_own_scaled_and_the_clip_counts_them_all"]),
    Mutation("sharded-collectives-unordered", "a sharded step's collectives are issued in whatever order TensorFlow runs them",
             "dist_minimize/aggregation/sharded.py",
             "    if previous is None or tf.executing_eagerly():\n        return value\n",
             "    if True:\n        return value\n",
             ["tests/distributed/test_local_variables.py::test_local_gradients_are_each_ranks_own_scaled_and_the_clip_counts_them_all"]),
    Mutation("micro-batch-order-depends-on-n", "each worker takes every N-th sample, so micro-batch j of an update depends on N",
             "dist_minimize/elastic.py",
             "    return stream.shard(workers, rank) if workers > 1 else stream.prefetch(tf.data.AUTOTUNE)\n",
             "    return dataset.take(updates * global_batch).shard(workers, rank).batch(micro_batch, drop_remainder=True)\n",
             ["tests/unit/test_elastic.py::test_micro_batch_j_of_update_t_is_the_same_samples_whatever_the_worker_count"]),
    Mutation("micro-batch-count-not-adapted", "every worker accumulates all G / b micro-batches whatever N",
             "dist_minimize/elastic.py",
             "    return per_update // workers\n",
             "    return per_update\n",
             ["tests/unit/test_elastic.py::test_micro_batch_j_of_update_t_is_the_same_samples_whatever_the_worker_count"]),
    Mutation("per-worker-batch-grows", "a worker's batch is G / N samples (it grows as workers go) instead of b",
             "dist_minimize/elastic.py",
             "    stream = dataset.batch(micro_batch, drop_remainder=True).take(updates * per_update)\n",
             "    stream = dataset.batch(global_batch // workers, drop_remainder=True).take(updates * workers)\n",
             ["tests/unit/test_elastic.py::test_micro_batch_j_of_update_t_is_the_same_samples_whatever_the_worker_count"]),
    Mutation("join-sigterm-ignored", "the join watcher does not see a SIGTERM pending on the worker",
             "dist_minimize/launch/join_watch.py",
             "    return bool(pending >> (signal.SIGTERM - 1) & 1)\n",
             "    return False\n",
             ["tests/unit/test_cluster_join.py::test_sigterm_during_the_wait_ends_the_worker_within_seconds"]),
    Mutation("join-sigterm-kept-blocked", "a worker that joined keeps SIGTERM blocked for the rest of its run",
             "dist_minimize/cluster.py",
             "        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})\n",
             "        pass\n",
             ["tests/unit/test_cluster_join.py::test_a_one_worker_job_joins_and_releases_sigterm"]),
    Mutation("resume-other-accumulation", "a checkpoint of another accumulation resumes at a position meaning another update",
             "dist_minimize/checkpoint.py",
             "        if written_micro != self._micro and written_micro * written_workers != self._micro * workers:\n",
             "        if False:\n",
             ["tests/unit/test_checkpoint.py::test_a_checkpoint_of_another_accumulation_is_refused"]),
    Mutation("resize-position-in-batches", "a checkpoint written on N workers resumes at its batch count on M, not its update",
             "dist_minimize/checkpoint.py",
             "        return meta[\"step\"] // written_micro * self._micro\n",
             "        return meta[\"step\"]\n",
             ["tests/unit/test_checkpoint.py::test_a_position_moves_to_another_number_of_workers_by_updates"]),
    Mutation("resize-micro-step-not-rebased", "after a resize the accumulation counts its windows from the old worker count's micro-steps",
             "dist_minimize/checkpoint.py",
             "            _set_micro_steps(self.optimizer, step)\n",
             "            pass\n",
             ["tests/distributed/test_elastic_resize.py::test_new_slots_grow_the_job_at_a_checkpoint_and_the_result_stays"]),
    Mutation("resize-ignores-discovery", "a running job is never resized when discovery reports another count",
             "dist_minimize/launcher.py",
             "        if n is not None and n != self.workers:\n",
             "        if False:\n",
             ["tests/unit/test_launcher_elastic.py::test_a_running_job_is_resized_when_discovery_changes"]),
    Mutation("restart-on-the-old-count", "after a failure the job starts again on as many workers as before, not on the slots left",
             "dist_minimize/launcher.py",
             "        n = choose(sum(k for _, k in slots))\n",
             "        n = workers or choose(sum(k for _, k in slots))\n",
             ["tests/unit/test_launcher_elastic.py::test_a_failed_worker_restarts_the_job_on_the_slots_left"]),
    Mutation("below-min-np-starts-anyway", "with fewer slots than --min-np the job starts on them instead of waiting",
             "dist_minimize/launcher.py",
             "        return next((n for n in range(min(max_np, total), min_np - 1, -1)\n",
             "        return next((n for n in range(min(max_np, total), 0, -1)\n",
             ["tests/unit/test_launcher_elastic.py::test_too_few_slots_wait_then_stop_with_a_clear_message"]),
    Mutation("discovery-unbounded", "a discovery script that hangs is waited for without a bound",
             "dist_minimize/launch/discovery.py",
             "            out, err = p.communicate(timeout=self.timeout)\n",
             "            out, err = p.communicate()\n",
             ["tests/unit/test_launcher_elastic.py::test_a_discovery_that_fails_ends_the_launch_with_its_reason_in_bounded_time"]),
    Mutation("constant-multiplier-from-epoch-0", "a constant multiplier counts epochs from 0, not from start_epoch",
             "dist_minimize/horovod_keras/learning_rate.py",
             "            self.multiplier = lambda epoch: constant ** (epoch - start_epoch)\n",
             "            self.multiplier = lambda epoch: constant ** epoch\n",
             ["tests/unit/test_learning_rate.py::test_schedule_staircase_with_a_number_is_exponential_per_epoch_inside_its_epochs"]),
]


def copy_repo(source: str, dest: str) -> None:
    skip = {".git", ".ci-venvs", "__pycache__", ".pytest_cache"}

    def ignore(folder, names):
        return [n for n in names if n in skip or n.startswith(".venv") or n.startswith(".test-logs")
                or n.endswith(".egg-info")]

    shutil.copytree(source, dest, ignore=ignore)


def run_tests(copy: str, tests: list[str], timeout: float) -> tuple[int, list[str], str]:
    env = {**os.environ, "PYTHONPATH": copy, "TF_CPP_MIN_LOG_LEVEL": "2"}
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfE", *tests]
    try:
        r = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout,
                           start_new_session=True)
        out, rc = r.stdout + r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return 124, [], out
    failed = sorted(set(re.findall(r"^(?:FAILED|ERROR) (\S+)", out, flags=re.M)))
    return rc, failed, out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", help="mutations to run (default: all)")
    p.add_argument("--list", action="store_true")
    p.add_argument("--out", default="mutations.md")
    p.add_argument("--timeout", type=float, default=900, help="seconds per pytest run")
    args = p.parse_args(argv)
    if args.list:
        for m in MUTATIONS:
            print(f"{m.name:28} {m.what}")
        return 0
    known = {m.name: m for m in MUTATIONS}
    unknown = [n for n in args.names if n not in known]
    if unknown:
        p.error(f"unknown mutation(s) {unknown}; see --list")
    chosen = [known[n] for n in args.names] if args.names else MUTATIONS

    rows, status = [], 0
    with tempfile.TemporaryDirectory(prefix="dm-mutations-") as tmp:
        # One snapshot of the working tree at the start: edits made while this runs do
        # not leak into later mutations.
        snapshot = os.path.join(tmp, "snapshot")
        copy_repo(ROOT, snapshot)
        control = os.path.join(tmp, "control")
        copy_repo(snapshot, control)
        tests = sorted({t for m in chosen for t in m.tests})
        start = time.monotonic()
        rc, failed, out = run_tests(control, tests, args.timeout)
        print(f"[mutations] control run of {len(tests)} test selections: exit {rc} "
              f"({time.monotonic() - start:.0f} s)", flush=True)
        if rc != 0:
            print(out[-5000:])
            print("[mutations] the unmutated copy fails these tests; fix that first", file=sys.stderr)
            return 1
        shutil.rmtree(control)
        for m in chosen:
            copy = os.path.join(tmp, m.name)
            copy_repo(snapshot, copy)
            path = os.path.join(copy, m.path)
            with open(path) as f:
                text = f.read()
            for old, new in m.edits():
                if text.count(old) != 1:
                    print(f"[mutations] {m.name}: the text to change occurs {text.count(old)} times in {m.path}; "
                          "update the mutation", file=sys.stderr)
                    return 2
                text = text.replace(old, new)
            with open(path, "w") as f:
                f.write(text)
            start = time.monotonic()
            rc, failed, out = run_tests(copy, m.tests, args.timeout)
            caught = rc != 0 and bool(failed)
            status |= 0 if caught else 1
            rows.append((m, caught, failed, time.monotonic() - start))
            print(f"[mutations] {m.name}: {'CAUGHT' if caught else 'NOT CAUGHT'} "
                  f"({len(failed)} failing, {time.monotonic() - start:.0f} s)", flush=True)
            for t in failed[:8]:
                print(f"    {t}")
            if not caught and rc != 0:
                print(out[-3000:])
            shutil.rmtree(copy)
    lines = ["| mutation | caught | failing tests: how many, and the test functions they belong to |",
             "|---|---|---|"]
    for m, caught, failed, _ in rows:
        functions = sorted({f"{t.split('::')[0].rsplit('/', 1)[-1][:-3]}::{t.split('::')[1].split('[')[0]}"
                            for t in failed if "::" in t})
        lines.append(f"| `{m.name}`: {m.what} | {'yes' if caught else '**NO**'} | "
                     f"{len(failed)}: {', '.join(functions) or '-'} |")
    table = "\n".join(lines)
    print(table)
    with open(args.out, "w") as f:
        f.write(table + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
