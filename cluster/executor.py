"""``RayExecutor``: a replica's actors behind the engine's ``Executor`` protocol.

Startup: plan placement (pure) -> reserve the placement group -> start one actor per process ->
join one ``torch.distributed`` group (NCCL on GPUs, gloo on CPUs; world = TP ranks + a separate
drafter, TP subgroup = ranks 0..N-1) -> load weights (each rank reads its slice) -> allocate the
replica's KV pages (the minimum any process holds) -> compile the step. Each step is one round trip
through a Ray Compiled Graph (``experimental_compile``: the batch goes to every actor's ``execute`` over
shared-memory channels and the results come back the same way): vLLM's choice for its Ray executor, Ray's own
machinery rather than a hand-made transport. What travels is the batch's delta in plain tuples
(``cluster.dispatch``: pages added since the last step, parameters once per request), since pickling whole
batches dominated at large batch sizes (``benchmarks/dispatch.py``). Tensors move between actors over
torch.distributed only. Other calls (load, info, health) stay ordinary actor tasks. The batch carries the engine's
run-ahead mark and the next verify's length, so a single-rank replica's worker plans the next step while the
drafter drafts and launches it ahead as one process does (``verifies_ahead``), and every rank of a replica without a
drafter launches steady decode steps ahead (``runs_ahead``).

Idle parking: an armed compiled graph's actors wait for the next step in Ray's channel read, which spins (a
``sched_yield`` loop: a whole CPU core per actor, and the same on the driver while it waits for a step), also while
the replica has nothing to do. After ``ParallelConfig.idle_park_s`` without a step the executor tears the graph
down (the actors then block in Ray's ordinary task loop, using nothing); the next step compiles it again first
(~0.1-0.2 s on a CPU host, plus the first executions' warmup; the engine calls ``arm`` before it times a step).
``stats``: the parks so far and whether the replica is parked now.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from typing import Generator

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.actors.workers import Drafter, TargetShard
from cluster.dispatch import BatchEncoder, decode_any, decode_results
from cluster.placement import groups
from cluster.placement.plan import plan_placement
from configs import ReplicaConfig
from runtime.engine.executor import ExecutorBase, plans_ahead, replica_pages
from runtime.scheduling.step_io import RequestStepResult, ScheduledBatch
from runtime.worker.transfer import DeviceWait
from runtime.worker.worker import WorkerPlan

log = logging.getLogger(__name__)
# Ray logs every compiled graph's teardown step by step at INFO on the driver's stderr: keep its warnings only
logging.getLogger("ray.dag.compiled_dag_node").setLevel(logging.WARNING)


def runs_ahead(plans_ahead: bool, tensor_parallel_size: int, roles: list[str], speculative: bool) -> bool:
    """Whether the engine may mark steady greedy decode steps to run ahead (``ScheduledBatch.run_ahead``) on this
    replica: every target rank runs CUDA graphs that plan ahead and no separate drafter takes part. Each rank then
    launches the next decode step before this one's results travel back to the driver, so the GPUs work while the
    step's round trip (``benchmarks/dispatch.py``: ~0.16 ms at one request) and the engine's commit run, as in one
    process. Tensor-parallel ranks do so only without a drafter: every rank decides alike from the same batch and the
    same verdicts (gathered inside the graph), so the collectives of the steps they launch pair up, but a colocated
    drafter's context lives on rank 0 alone, and its steps take the general path (``ModelRunner._decodes_greedy``).
    Marking steps no rank launches ahead would only make arrivals wait a step."""
    return plans_ahead and "drafter" not in roles and (tensor_parallel_size == 1 or not speculative)


def verifies_ahead(plans_ahead: bool, tensor_parallel_size: int, roles: list[str]) -> bool:
    """Whether the engine may mark steady greedy verify steps to run ahead: the next block's verify launched right
    behind its draft (``GraphedTargetForward.launch_verify_ahead``), which needs the block on the device of every
    target rank: only a single rank with its drafter colocated."""
    return plans_ahead and tensor_parallel_size == 1 and "drafter" not in roles


class ReplicaFailure(RuntimeError):
    """An actor of the replica died or hung; in-flight requests are lost and the replica must be rebuilt."""


class RayExecutor(ExecutorBase):
    def __init__(self, config: ReplicaConfig):
        self.config = config
        parallel, engine = config.parallel, config.engine
        self.use_gpus = engine.device != "cpu" and ray.cluster_resources().get("GPU", 0) > 0
        if engine.device.startswith("cuda") and not self.use_gpus:
            raise ValueError(f"device={engine.device!r} but the Ray cluster has no GPUs")
        if parallel.allreduce_strategy == "ONESHOT" and not self.use_gpus:
            raise ValueError("parallel.allreduce_strategy='ONESHOT' runs on CUDA devices and this replica runs on "
                             "CPUs; allowed there: 'NCCL' (gloo's all-reduce) or 'AUTO'")
        speculative = engine.speculative_config is not None
        self.plan = plan_placement(parallel, speculative, self.use_gpus, groups.cluster_nodes())
        self.owns_group = parallel.placement_group == "own"
        # the engine alternates two request groups while at least pipeline_drafter_min_batch requests run; the
        # drafter's blocks of the previous step's group come back with each step (take_late_drafts)
        self.pipelined_drafting = speculative and parallel.drafter == "separate" and parallel.pipeline_drafter
        self.pipeline_min_batch = parallel.pipeline_drafter_min_batch
        self._late_drafts: dict = {}
        if self.owns_group:
            self.group, self.first_bundle = groups.create(self.plan, f"dspark-{uuid.uuid4().hex[:8]}",
                                                          parallel.init_timeout_s), 0
        else:  # a Serve replica: Serve reserved [the replica's own bundle] + the plan's bundles
            self.group, self.first_bundle = groups.enclosing(self.plan), 1
        self.actors = []
        self.step_graph = None
        # idle parking: the step path and the parker take turns on the graph (an uncontended lock a step)
        self._graph_lock = threading.Lock()
        self._last_step = time.monotonic()
        self._closing = threading.Event()
        self._parker: threading.Thread | None = None
        self.parks = 0  # times the graph was torn down after idle_park_s without a step
        self.encoder = BatchEncoder()
        self.yields_device_waits = True  # one wait a step, while the actors compute it: the engine's host work
        try:
            self._start_actors(speculative)
            self.num_pages = replica_pages(engine, self._call_all("load"))
            self._call_all("allocate", self.num_pages)
            self.plans_ahead = plans_ahead(self._call_all("info"))  # the engine then allots pages a token ahead
            self.runs_ahead = runs_ahead(self.plans_ahead, parallel.tensor_parallel_size, self.plan.roles,
                                         speculative)
            self.verifies_ahead = verifies_ahead(self.plans_ahead, parallel.tensor_parallel_size, self.plan.roles)
            self.step_graph = self._compile_step()
        except BaseException:
            self.shutdown()
            raise
        if parallel.idle_park_s is not None:
            self._parker = threading.Thread(target=self._park_when_idle, args=(parallel.idle_park_s,),
                                            name="dspark-idle-parker", daemon=True)
            self._parker.start()

    def _compile_step(self):
        """The step as a Ray Compiled Graph: one input (the batch) to every actor's ``execute``, all outputs."""
        from ray.dag import InputNode, MultiOutputNode

        with InputNode() as batch:
            dag = MultiOutputNode([actor.execute.bind(batch) for actor in self.actors])
        return dag.experimental_compile()

    def _park_when_idle(self, idle_s: float) -> None:
        """The parker thread: tear the step graph down once no step has run for ``idle_s`` seconds."""
        while not self._closing.wait(idle_s / 4):
            with self._graph_lock:
                if self.step_graph is not None and time.monotonic() - self._last_step >= idle_s:
                    # counted first: a reader that sees the replica parked (stats(), unlocked) sees this park too
                    self.parks += 1
                    self._teardown_graph()
                    log.debug("dspark: replica idle for %.1f s: step graph parked", idle_s)

    def _teardown_graph(self) -> None:
        if self.step_graph is not None:
            try:
                self.step_graph.teardown()
            except Exception:  # noqa: BLE001 - a dead actor's loop is gone already; the others are cancelled
                pass
            self.step_graph = None

    @property
    def parked(self) -> bool:
        """Whether the step graph is torn down (idle); the next step compiles it again."""
        return self.step_graph is None and bool(self.actors)

    def stats(self) -> dict:
        """Counters the engine's ``get_metrics`` reports beside its own."""
        return {"replica_idle_parks": self.parks, "replica_parked": self.parked}

    def _start_actors(self, speculative: bool) -> None:
        parallel, engine = self.config.parallel, self.config.engine
        tp = parallel.tensor_parallel_size
        drafter_mode = parallel.drafter if speculative else None
        resources = {"num_gpus": 1} if self.use_gpus else {"num_cpus": 1}
        # Inside an actor Ray exposes exactly its own GPU (or none) as the visible device.
        engine = engine.model_copy(update={"device": "cuda" if self.use_gpus else "cpu"})
        for rank, role in enumerate(self.plan.roles):
            plan = WorkerPlan(role=role, tp_rank=rank if role == "target" else 0, tp_size=tp, drafter=drafter_mode)
            cls = TargetShard if role == "target" else Drafter
            strategy = PlacementGroupSchedulingStrategy(
                self.group, placement_group_bundle_index=self.first_bundle + self.plan.rank_to_bundle[rank])
            self.actors.append(ray.remote(**resources)(cls).options(scheduling_strategy=strategy).remote(engine, plan))
        if len(self.actors) > 1:
            backend = parallel.distributed_backend
            backend = backend if backend != "auto" else ("nccl" if self.use_gpus else "gloo")
            address = ray.get(self.actors[0].rendezvous.remote(), timeout=parallel.init_timeout_s)
            self._call_all("join", address, backend, parallel.init_timeout_s, parallel.allreduce_strategy)

    def _call_all(self, method: str, *args, timeout_s: float | None = None):
        """Call ``method`` on every actor at once; an error raised inside an actor is re-raised naming its
        rank and role; a dead or hung actor becomes ``ReplicaFailure``."""
        timeout_s = timeout_s or self.config.parallel.init_timeout_s
        refs = [getattr(actor, method).remote(*args) for actor in self.actors]
        try:
            return ray.get(refs, timeout=timeout_s)
        except Exception as exc:  # noqa: BLE001 - translated (or re-raised) by _raise_from
            rank = next((r for r, ref in enumerate(refs) if _failed(ref)), None) \
                if isinstance(exc, ray.exceptions.RayTaskError) else None
            _raise_from(exc, f"rank {rank} ({self.plan.roles[rank]})" if rank is not None else "a replica actor",
                        method)

    def execute(self, batch: ScheduledBatch) -> Generator[DeviceWait, None, list[RequestStepResult]]:
        """One step: the batch's delta (``cluster.dispatch``) through the compiled graph; rank 0's results, with a
        separate drafter's proposals merged in. A generator: it yields once, while the actors compute the step."""
        try:
            results = yield from self._run_step(self.encoder.encode(batch))
        except BaseException:
            self.encoder.reset()  # what the actors applied is unknown: the next step starts over
            raise
        step = decode_results(results[0])
        if self.plan.roles[-1] == "drafter":
            # request id -> (block, its confidences or None): of the group a pipelined step before kept (not in this
            # batch), and of this batch's requests (a step that is not pipelined)
            late, drafts = decode_any(results[-1])
            self._late_drafts = late
            if batch.pipelined:
                return step
            step = [dataclasses.replace(r, next_draft_ids=drafts.get(r.request_id, ([], None))[0],
                                        next_draft_confidence=drafts.get(r.request_id, ([], None))[1]) for r in step]
        return step

    def take_late_drafts(self) -> dict[str, tuple[list[int], list[float] | None]]:
        """Pipelined drafting: the blocks the drafter made in the last step for the group verified before it."""
        drafts, self._late_drafts = self._late_drafts, {}
        return drafts

    def _run_step(self, wire) -> Generator[DeviceWait, None, list]:
        with self._graph_lock:
            try:
                return (yield from self._run_armed_step(wire))
            finally:
                self._last_step = time.monotonic()

    def arm(self) -> None:
        """Ready the step graph: the engine calls this first thing in a step, before it times the step, so that a
        parked replica compiles its graph again there and the step time the engine learns from is the step's."""
        if self.step_graph is None:
            with self._graph_lock:
                self._arm_graph()

    def _arm_graph(self) -> None:
        if self.step_graph is None:  # parked while idle: compile it again
            try:
                self.step_graph = self._compile_step()
            except Exception as exc:  # noqa: BLE001 - translated (or re-raised) by _raise_from
                _raise_from(exc, "a replica actor", "compile the step graph")
            finally:
                self._last_step = time.monotonic()  # (not parked again before the step comes)

    def _run_armed_step(self, wire) -> Generator[DeviceWait, None, list]:
        self._arm_graph()  # (parked between the engine's arm() and now: rare)
        try:
            ref = self.step_graph.execute(wire)
        except Exception as exc:  # noqa: BLE001 - translated (or re-raised) by _raise_from
            _raise_from(exc, "a replica actor", "execute")
        # a device wait: the engine's deferred host work runs while the actors compute the step (an error of it is
        # the engine's own, raised once the step's results are collected: runtime.engine.host_work.run_step)
        yield None
        try:
            return ray.get(ref, timeout=self.config.parallel.step_timeout_s)
        except Exception as exc:  # noqa: BLE001 - translated (or re-raised) by _raise_from
            _raise_from(exc, "a replica actor", "execute")

    def describe(self) -> list[dict]:
        return self._call_all("info")

    def start_profile(self, steps: int, trace: str | None = None) -> None:
        """Every rank profiles its next ``steps`` steps (``runtime.kernels.profiling.StepProfiler``); ``trace`` (a path
        ending .json.gz): each rank also writes its timeline there on its own host, named by rank."""
        refs = [actor.start_profile.remote(steps, _rank_trace(trace, rank)) for rank, actor in enumerate(self.actors)]
        ray.get(refs, timeout=self.config.parallel.init_timeout_s)

    def profile_results(self) -> list[dict]:
        """Each rank's summary of its last finished profile, with its rank and role (None where none finished)."""
        results = self._call_all("profile_result")
        return [{"rank": rank, "role": role, **(result or {"unfinished": True})}
                for rank, (role, result) in enumerate(zip(self.plan.roles, results))]

    def health(self, timeout_s: float = 30.0) -> list[dict]:
        """Every actor's info, or ``ReplicaFailure`` naming the first that is dead or silent."""
        return self._call_all("info", timeout_s=timeout_s)

    def shutdown(self) -> None:
        self._closing.set()
        if self._parker is not None:
            self._parker.join()
            self._parker = None
        self._teardown_graph()  # before the actors go: its loops run on them
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []
        if self.owns_group:  # an enclosing group is Serve's: it goes with the Serve replica
            groups.remove(self.group)
        self.group = None


def _rank_trace(trace: str | None, rank: int) -> str | None:
    """``DIR/name.trace.json.gz`` -> ``DIR/name.rank{rank}.trace.json.gz``."""
    if trace is None:
        return None
    head, dot, tail = trace.partition(".trace")
    return f"{head}.rank{rank}{dot}{tail}" if dot else f"{trace}.rank{rank}"


def _raise_from(exc: Exception, where: str, method: str):
    """An error of a replica call, as the engine sees it: an actor's ValueError/RuntimeError re-raised naming
    ``where``; a dead, hung or disconnected actor as ``ReplicaFailure``; anything else unchanged."""
    if isinstance(exc, ray.exceptions.RayTaskError):
        cause = exc.cause if exc.cause is not None else exc
        if isinstance(cause, (ValueError, RuntimeError)):
            raise type(cause)(f"{where}: {cause}") from exc
        raise exc
    if isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError,
                        ray.exceptions.RayChannelError, TimeoutError)):
        raise ReplicaFailure(f"replica actor failed during {method!r}: {_reason(exc)}") from exc
    raise exc


def _failed(ref) -> bool:
    ready, _ = ray.wait([ref], timeout=0)
    if not ready:
        return False
    try:
        ray.get(ref)
    except Exception:
        return True
    return False


def _reason(exc: Exception) -> str:
    if isinstance(exc, (ray.exceptions.GetTimeoutError, TimeoutError)):
        return "no answer within the timeout (a hung collective or a lost node)"
    return str(exc).strip().splitlines()[0][:300]
