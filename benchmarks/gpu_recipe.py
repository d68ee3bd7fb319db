"""The GPU recipe: a small code target, its DSpark drafter and a DFlash baseline, evaluated at K=7.

Every stage is time-boxed so it fits a 10-minute run on an H200, and stages chain: a rerun with the same
``--work`` skips finished stages (``--stages`` picks some) and resumes the drafters, so back-to-back runs on
a warm machine train longer; ``--run-seconds`` fits the drafters' training into what is left of a run. Each
stage records itself in ``WORK/stage-NAME.json``; with ``--gpus N`` every stage uses N GPUs: the target
trains data parallel (torchrun), distillation runs in N shards, the drafters train side by side and are
evaluated side by side, one child process per GPU:
  1. target: a Qwen3-architecture model (~27M parameters by default, ``--target-hidden``/``--target-layers``)
     + byte-level BPE on the stdlib sources or ``--corpus`` (bf16 autocast, cosine learning rate that reaches 0
     at ``--target-seconds``; the 24 MB stdlib is small enough that the target memorizes it, a larger corpus pays)
  2. distill: the target answers code prompts greedily (self-distillation; ``--shard I/N`` splits the prompts
     over processes); the drafters' data is those answers plus the training files' text
  3. dspark / dflash: train-drafter on the same data and budget, both with ``--draft-layers`` (default 2):
     DSpark (vanilla Markov head of rank ``--markov-rank``, confidence head, DeepSpec loss; its confidence
     temperatures then calibrated on other held-out windows, ``WORK/calibration-prompts.jsonl``) and DFlash
     (Markov rank 0, cross-entropy only)
  4. eval: both on held-out files' prompts at K=7, temperature 0 and 1
Writes one JSON record (stage statistics, tau, per-position acceptance), and ``WORK/heldout-prompts.jsonl``
(the held-out prompts, for ``dspark bench --model WORK/target --speculative-model WORK/dspark --prompts ...``).

usage: python benchmarks/gpu_recipe.py --out results.json --work /tmp/recipe
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from configs.training import DrafterTrainConfig, TargetTrainConfig  # noqa: E402
from runtime.engine.llm import LLM  # noqa: E402
from runtime.training.data_parallel import STATS_FILE  # noqa: E402
from runtime.training.distill import code_prompts, evaluate, regenerate  # noqa: E402
from runtime.training.drafter_trainer import train_drafter  # noqa: E402
from runtime.training.target_trainer import source_files, split, train_target  # noqa: E402

K = 7
ENGINE = dict(dtype="bfloat16", device="cuda", kv_cache_memory=16 << 30, max_num_seqs=256,
              max_num_batched_tokens=8192)
DISTILL_BATCH = dict(max_num_seqs=1024, max_num_batched_tokens=16384)  # regeneration: throughput first


HELDOUT_PROMPTS = "heldout-prompts.jsonl"  # the eval stage's held-out prompts as JSONL prompt_ids rows
CALIBRATION_PROMPTS = "calibration-prompts.jsonl"  # other held-out windows, for the confidence temperatures
STAGES = ("target", "distill", "dspark", "dflash", "eval")
PREPARE_SECONDS = 60  # a drafter process: imports, loading the target, tokenizing the data, the last save


def target_config(work: Path, args) -> TargetTrainConfig:
    heads = args.target_hidden // 64  # head_dim 64, two query heads per key/value head, MLP 3x wide
    cfg = TargetTrainConfig(out=str(work / "target"), data=args.corpus, vocab_size=4096,
                            hidden_size=args.target_hidden, num_layers=args.target_layers, num_heads=heads,
                            num_kv_heads=max(heads // 2, 1), intermediate_size=3 * args.target_hidden, max_len=512,
                            max_corpus_bytes=int(args.corpus_mb * (1 << 20)), batch_size=args.target_batch,
                            steps=args.target_steps, max_seconds=args.target_seconds, lr=args.target_lr,
                            device=ENGINE["device"], autocast="bfloat16")
    if args.smoke:
        cfg = cfg.model_copy(update=dict(vocab_size=512, hidden_size=64, num_layers=3, num_heads=2, num_kv_heads=1,
                                         intermediate_size=128, max_len=64, max_corpus_bytes=1 << 19, batch_size=4,
                                         steps=5, autocast="off"))
    return cfg


def drafter_configs(work: Path, target: str, data: Path, args) -> dict[str, DrafterTrainConfig]:
    common = dict(target=target, data=str(data), block_size=K, max_len=256, batch_size=args.drafter_batch,
                  num_anchors=64, steps=5 if args.smoke else args.drafter_steps, max_seconds=args.drafter_seconds,
                  lr=1e-3, device=ENGINE["device"], autocast="off" if args.smoke else "bfloat16",
                  target_dtype="float32" if args.smoke else "bfloat16", log_every=100,
                  save_every=2000)
    return {"dspark": DrafterTrainConfig(out=str(work / "dspark"), num_draft_layers=args.draft_layers,
                                         markov_rank=args.markov_rank, markov_head_type="vanilla",
                                         calibration_data=str(work / CALIBRATION_PROMPTS),
                                         calibration_prompts=8 if args.smoke else 64, **common),
            "dflash": DrafterTrainConfig(out=str(work / "dflash"), num_draft_layers=args.draft_layers,
                                         markov_rank=0, confidence_head=False, ce_weight=1.0, l1_weight=0.0,
                                         confidence_weight=0.0, **common)}


def distill(work: Path, target: str, train_files, tokenizer, args) -> dict:
    """The target answers this shard's share of the code prompts greedily -> WORK/distill-I-of-N.jsonl."""
    index, count = args.shard
    # every shard draws the whole (cheap, seeded) prompt list and answers its share: the union is what one
    # process would answer
    prompts = code_prompts(train_files, tokenizer, args.distill_prompts, 64, seed=1)[index::count]
    start = time.monotonic()
    regenerate(LLM(target, **{**ENGINE, **DISTILL_BATCH}), prompts, work / f"distill-{index}-of-{count}.jsonl",
               max_tokens=192)
    return {"seconds": time.monotonic() - start, "prompts": len(prompts), "shard": f"{index}/{count}"}


def drafter_data(work: Path, train_files) -> Path:
    """Every shard's distilled answers plus the training files' own text (held-out files excluded): the L1 term
    distills the target's distribution at every position, so raw code is distillation data too, and far more of
    it. Written once, atomically (two drafter processes may ask at the same time)."""
    data = work / "drafter-data.jsonl"
    if not data.is_file():
        answers = sorted(work.glob("distill-*.jsonl"))
        if not answers:
            raise SystemExit(f"no distilled answers in {work}: run the distill stage first")
        partial = work / f".drafter-data.{os.getpid()}"
        with partial.open("w") as f:
            for path in answers:
                f.write(path.read_text())
            for path in train_files:
                f.write(json.dumps({"text": path.read_text(encoding="utf-8", errors="replace")}) + "\n")
        partial.replace(data)
    return data


def shard(value: str) -> tuple[int, int]:
    index, _, count = value.partition("/")
    if not (index.isdigit() and count.isdigit() and 0 <= int(index) < int(count)):
        raise argparse.ArgumentTypeError(f"expected I/N with 0 <= I < N, got {value!r}")
    return int(index), int(count)


def child_argv(argv: list[str], drop: tuple[str, ...] = (), **replace) -> list[str]:
    """This run's arguments without the options in ``drop`` and with those in ``replace`` replaced (each
    given as ``--name value`` or ``--name=value``)."""
    names = {"--" + key.replace("_", "-") for key in replace} | set(drop)
    kept, skip_value = [], False
    for arg in argv:
        if skip_value:
            skip_value = False
        elif arg.split("=", 1)[0] in names:
            skip_value = "=" not in arg
        else:
            kept.append(arg)
    for key, value in replace.items():
        kept += ["--" + key.replace("_", "-"), str(value)]
    return kept


def fan_out(jobs: list[tuple[str, list[str]]], gpus: int, work: Path) -> None:
    """Run each (name, argv) as a child process of this script on its own GPU (round robin); wait for all.

    A child's output goes to ``WORK/NAME.log``; a failed child fails the run, naming its log. The children share
    the host's cores (each its share of threads, unless the caller set ``OMP_NUM_THREADS``: torch's threads spin
    while they wait, and two children each with a thread per core took 58 s for an evaluation that took 6 s so,
    on a 2-core host)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(gpus)]
    threads = str(max(1, (os.cpu_count() or 1) // len(jobs)))
    procs = []
    for i, (name, argv) in enumerate(jobs):
        log = (work / f"{name}.log").open("w")
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": devices[i % gpus],
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", threads)}  # a setting of the caller's stands
        procs.append((name, subprocess.Popen([sys.executable, __file__, *argv], stdout=log, stderr=subprocess.STDOUT,
                                             env=env)))
    failed = [name for name, proc in procs if proc.wait() != 0]
    if failed:
        raise SystemExit(f"stage processes failed: {', '.join(failed)} (see {work}/<name>.log)")


def torchrun(argv: list[str], log: Path) -> None:
    """``python -m torch.distributed.run ARGV`` with its output in ``log``; a failure fails the run."""
    with log.open("w") as f:
        code = subprocess.run([sys.executable, "-m", "torch.distributed.run", *argv], stdout=f,
                              stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise SystemExit(f"the data-parallel target stage failed (see {log})")


def join_process_group(args) -> None:
    """This torchrun rank joins its group: NCCL on its own GPU (``LOCAL_RANK``), gloo for --smoke."""
    if args.smoke:
        dist.init_process_group("gloo")
    else:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")


def drafter_done(cfg: DrafterTrainConfig) -> bool:
    stats = Path(cfg.out) / STATS_FILE
    return stats.is_file() and json.loads(stats.read_text()).get("step", 0) >= cfg.steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the JSON record to write")
    parser.add_argument("--work", required=True, help="working directory; stages found done there are skipped, "
                        "drafters resume, so back-to-back runs on a warm machine chain")
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}")
    parser.add_argument("--gpus", type=int, default=1, help="GPUs for the stages: the target data parallel "
                        "(torchrun); distill shards, the two drafters' training and their evaluation one child "
                        "process per GPU; default 1 (all in this process)")
    parser.add_argument("--run-seconds", type=float, default=None, help="this run's wall-time budget: the drafters "
                        f"train at most what is left after {PREPARE_SECONDS} s to prepare (and --eval-seconds when "
                        "eval is asked for)")
    parser.add_argument("--target-seconds", type=float, default=200, help="the target's training time (its "
                        "learning rate anneals to 0 by then)")
    parser.add_argument("--target-steps", type=int, default=6000)
    parser.add_argument("--target-hidden", type=int, default=512, help="the target's width, a multiple of 64 "
                        "(head_dim 64, two query heads per key/value head, MLP 3x); default 512 (~27M parameters "
                        "at 8 layers, ~88M at 768 and 12 layers)")
    parser.add_argument("--target-layers", type=int, default=8, help="the target's decoder layers")
    parser.add_argument("--target-lr", type=float, default=2e-3, help="the target's peak learning rate")
    parser.add_argument("--target-batch", type=int, default=48, help="the target's sequences (of 512 tokens) per "
                        "step; 48 fits an H200 up to 2048 wide and 16 layers (~0.8B); 3072 x 24 (~2.7B) ran out "
                        "of its 140 GB at 48: give it ~20")
    parser.add_argument("--drafter-seconds", type=float, default=75, help="training time per drafter per run")
    parser.add_argument("--drafter-steps", type=int, default=20000, help="total steps a drafter trains to")
    parser.add_argument("--drafter-batch", type=int, default=64, help="sequences per drafter step")
    parser.add_argument("--draft-layers", type=int, default=2, help="decoder layers of both drafters")
    parser.add_argument("--markov-rank", type=int, default=64, help="DSpark's Markov head rank (DFlash: 0)")
    parser.add_argument("--distill-prompts", type=int, default=1536, help="prompts over all distill shards")
    parser.add_argument("--shard", type=shard, default=(0, 1), help="distill: this process's share I/N of the "
                        "prompts; default 0/1 (--gpus sets it for its children)")
    parser.add_argument("--corpus", default=None, help="folder of *.py files for the target, distillation prompts "
                        "and evaluation; default: this interpreter's standard library")
    parser.add_argument("--corpus-mb", type=float, default=24, help="source megabytes read from --corpus")
    parser.add_argument("--eval-prompts", type=int, default=128, help="held-out prompts (and as many from "
                        "training files, at temperature 0, to show how much of tau is memorized)")
    parser.add_argument("--eval-seconds", type=float, default=90, help="what --run-seconds keeps for the eval "
                        "stage (90 s fits the default sizes)")
    parser.add_argument("--eval-drafter", choices=("dspark", "dflash"), default=None, help="eval: only this "
                        "drafter (--gpus sets it for its children, one drafter per GPU)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU, to check the script runs")
    args = parser.parse_args()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)  # (one run trained a pair for ~4 minutes and then
    # lost its record to an OUT subfolder nobody had made)
    if args.smoke:
        ENGINE.update(dtype="float32", device="cpu", kv_cache_memory=1 << 28)
    wanted = set(args.stages.split(","))
    if not wanted <= set(STAGES):
        raise SystemExit(f"--stages: choose from {','.join(STAGES)}")
    if args.target_hidden % 64 or args.target_hidden < 64:
        raise SystemExit(f"--target-hidden {args.target_hidden}: a positive multiple of 64")
    if args.target_batch < 1:
        raise SystemExit(f"--target-batch {args.target_batch}: a positive number of sequences")
    if args.gpus < 1 or (not args.smoke and args.gpus > torch.cuda.device_count()):
        raise SystemExit(f"--gpus {args.gpus}: this machine has {torch.cuda.device_count()} CUDA GPUs")
    work, t0 = Path(args.work), time.monotonic()
    work.mkdir(parents=True, exist_ok=True)

    def recorded() -> dict:
        return {f.stem.removeprefix("stage-"): json.loads(f.read_text()) for f in sorted(work.glob("stage-*.json"))}

    stages = recorded()

    def finished(name: str, record: dict) -> None:
        stages[name] = record
        (work / f"stage-{name}.json").write_text(json.dumps(record))

    target_cfg = target_config(work, args)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # one rank of the data-parallel target stage, under torchrun
        if wanted != {"target"}:
            raise SystemExit("under torchrun only --stages target runs (data parallel)")
        join_process_group(args)
        stats = train_target(target_cfg, progress=False)
        if dist.get_rank() == 0:
            finished("target", stats)
        dist.destroy_process_group()
        return
    if "target" in wanted and "target" not in stages:
        if args.gpus > 1:
            torchrun(["--standalone", "--nproc-per-node", str(args.gpus), __file__,
                      *child_argv(sys.argv[1:], drop=("--run-seconds",), stages="target", gpus=1,
                                  out=work / "target.json")], work / "target.log")
            stages = recorded()
        else:
            finished("target", train_target(target_cfg, progress=False))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_cfg.out)
    train_files, heldout = split(source_files(target_cfg.data, target_cfg.max_corpus_bytes), target_cfg.heldout_every)
    held_prompts = code_prompts(heldout, tokenizer, args.eval_prompts, 64, seed=2)
    prompts_file = work / HELDOUT_PROMPTS
    if not prompts_file.is_file():  # for dspark bench --prompts: the pair's acceptance on text it never saw
        prompts_file.write_text("".join(json.dumps({"prompt_ids": ids}) + "\n" for ids in held_prompts))
    calibration_file = work / CALIBRATION_PROMPTS
    if not calibration_file.is_file():  # other held-out windows: the DSpark drafter's confidence calibration
        calibration_file.write_text("".join(json.dumps({"prompt_ids": ids}) + "\n" for ids in code_prompts(
            heldout, tokenizer, 8 if args.smoke else 64, 64, seed=4)))
    if "distill" in wanted:
        if args.shard != (0, 1):  # one shard, in this process (a child of --gpus, or by hand)
            name = "distill-{}-of-{}".format(*args.shard)
            if name not in stages:
                finished(name, distill(work, target_cfg.out, train_files, tokenizer, args))
        elif "distill" not in stages and args.gpus > 1:
            missing = [i for i in range(args.gpus) if f"distill-{i}-of-{args.gpus}" not in stages]
            fan_out([(f"distill-{i}-of-{args.gpus}", child_argv(
                sys.argv[1:], drop=("--run-seconds",), stages="distill", shard=f"{i}/{args.gpus}", gpus=1,
                out=work / f"distill-{i}-of-{args.gpus}.json")) for i in missing], args.gpus, work)
            stages = recorded()
        elif not any(name.startswith("distill") for name in stages):
            finished("distill", distill(work, target_cfg.out, train_files, tokenizer, args))
    drafters = drafter_configs(work, target_cfg.out, work / "drafter-data.jsonl", args)
    to_train = [name for name in drafters if name in wanted and not drafter_done(drafters[name])]
    if to_train:
        seconds = args.drafter_seconds
        if args.run_seconds is not None:
            reserve = PREPARE_SECONDS + (args.eval_seconds if "eval" in wanted else 0)
            seconds = min(seconds, args.run_seconds - (time.monotonic() - t0) - reserve)
        if seconds < 10:
            raise SystemExit(f"gpu_recipe: no time left to train {', '.join(to_train)} in --run-seconds "
                             f"{args.run_seconds} ({time.monotonic() - t0:.0f} s spent before them): raise "
                             "--run-seconds or lower --target-seconds")
        elif args.gpus > 1 and len(to_train) > 1:
            drafter_data(work, train_files)
            fan_out([(f"train-{name}", child_argv(sys.argv[1:], drop=("--run-seconds",), stages=name, gpus=1,
                                                  drafter_seconds=seconds, out=work / f"train-{name}.json"))
                     for name in to_train], args.gpus, work)
            stages = recorded()
        else:
            drafter_data(work, train_files)
            for name in to_train:  # resumes a previous run's checkpoint
                cfg = drafters[name].model_copy(update={"max_seconds": seconds})
                finished(f"train-{name}", train_drafter(cfg, progress=False))
    gpu = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    record = {"benchmark": "gpu_recipe", "date": datetime.date.today().isoformat(),
              "command": " ".join(["python", *sys.argv]), "hardware": {"gpus": gpu},
              "software": {"torch": torch.__version__, "python": platform.python_version()},
              "max_draft_len": K, "stages": stages, "results": {}}
    if "eval" in wanted:
        trained = [name for name, cfg in drafters.items() if (Path(cfg.out) / "config.json").is_file()
                   and args.eval_drafter in (None, name)]
        if not trained:
            raise SystemExit(f"eval: no trained {args.eval_drafter or 'drafter'} in {work} (train dspark and/or "
                             "dflash first)")
        if args.gpus > 1 and len(trained) > 1:  # one child per drafter, each on its own GPU
            fan_out([(f"eval-{name}", child_argv(sys.argv[1:], drop=("--run-seconds",), stages="eval", gpus=1,
                                                 eval_drafter=name, out=work / f"eval-{name}.json"))
                     for name in trained], args.gpus, work)
            for name in trained:
                record["results"][name] = json.loads((work / f"eval-{name}.json").read_text())["results"][name]
        else:
            seen_prompts = code_prompts(train_files, tokenizer, args.eval_prompts, 64, seed=3)
            for name in trained:
                out = drafters[name].out
                result = {f"t={t}": evaluate(target_cfg.out, out, held_prompts, K, t, 128, **ENGINE)
                          for t in (0.0, 1.0)}
                result["training_files_t=0.0"] = evaluate(target_cfg.out, out, seen_prompts, K, 0.0, 128, **ENGINE)
                record["results"][name] = result
                Path(args.out).write_text(json.dumps(record, indent=2))  # partial records survive a timeout
        results = record["results"]
        if {"dspark", "dflash"} <= results.keys():
            record["dspark_over_dflash_tau"] = {t: results["dspark"][t]["mean_acceptance_length"]
                                                / results["dflash"][t]["mean_acceptance_length"]
                                                for t in results["dspark"]}
    record["total_seconds"] = time.monotonic() - t0
    Path(args.out).write_text(json.dumps(record, indent=2))
    print(json.dumps({"tau": {n: {t: round(r[t]["mean_acceptance_length"], 3) for t in r}
                              for n, r in record["results"].items()},
                      "gain": record.get("dspark_over_dflash_tau"), "total_seconds": record["total_seconds"]},
                     indent=1))


if __name__ == "__main__":
    main()
