"""``treecompile train-drafter``: train an EAGLE-3 draft head for an HF target on self-distilled data.

Three stages, each resumable from what it left in the output directory ``DIR``:

1. **Data** (``DIR/data/gen_<start>_<stop>.pt``, one shard per generation batch): the target's own greedy
   continuations of the training prompts (:func:`treecompile.prompts.training_prompts`, chat template
   applied), produced by HF ``generate`` in batches. While generating, a logits processor records the
   target's top-k log-probs at every generated position (``k`` ids and values a token). The aux hidden
   states EAGLE-3 fuses (HF ``hidden_states`` at ``aux_layers``, every position but the last) come from one
   of two places (``--features``; ``auto``, the default, picks ``stored`` when its upper bound fits a quarter
   of the host memory and half the free disk of ``DIR``, else ``online``; an existing data directory keeps
   its mode):

   - ``online``: not stored; the target runs over the training batches (parallel forwards, no cache,
     8 steps' batches a round: :func:`_online_features`) for them. The data stays small at any target size:
     stored features cost ``len(aux_layers) * H`` 16-bit values a token (3.5 KB for SmolLM2, 24 KB for an
     8B Llama), so millions of tokens of them do not fit a machine's memory or disk. SpecForge's "online"
     EAGLE-3 training makes the same trade.
   - ``stored``: once a shard's continuations are generated, parallel forwards over the finished
     sequences compute them (the forwards ``online`` runs in every training step, run once:
     :func:`_stored_features`), and the shards hold them in float16. Faster to train where they fit (an
     extra forward a step costs more than reading them back: ``_resolve_features``).

   A finished shard is never regenerated.
2. **Draft vocabulary**: the V most frequent tokens the target generated (ties to the lower id), padded
   with its next most likely alternatives when fewer occur; ``d2t`` / ``t2d`` as in EAGLE-3.
3. **Training** (``DIR/checkpoint.pt`` every ``--checkpoint-every`` steps, and on Ctrl-C): EAGLE-3's
   objective. Draft position p holds the pair (fused target hidden at p, token at p + 1) and predicts the
   token at p + 2 against the target's distribution there (soft cross-entropy over the top-k restricted to
   the draft vocabulary). Training-time test (``--ttt-steps J``, EAGLE-3): step j feeds the head's own
   step j-1 output at base b with the token at b + j + 1 at position b + j, attending to the step-0 keys
   of positions <= b plus its own chain's keys of steps 1..j, which is exactly what a lane row sees at
   inference (:meth:`EagleDrafter.draft_lanes`); step j's loss is weighted 0.8^j. The head's ``lm_head``
   and ``norm`` start from the target's (its rows for the draft vocabulary).

Every checkpoint also exports the layout :meth:`EagleDrafter.from_pretrained` reads: ``DIR/config.json``
and ``DIR/model.safetensors`` (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``; float16 by
default), plus ``DIR/training.json`` (the command, data size, steps, time, losses).

Shapes: B sequences, T pair positions (sequence length - 1), F = len(aux_layers) * H_target features,
H head width, Vd draft vocabulary, k recorded top-k.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from torch import nn

logger = logging.getLogger(__name__)

__all__ = [
    "TrainConfig",
    "train_drafter",
    "load_target",
    "chat_ids",
    "generate_data",
    "build_draft_vocab",
    "init_head",
    "warm_head",
    "ttt_forward",
    "export_head",
]

DATA_FORMAT = 1
CHECKPOINT = "checkpoint.pt"
STEP_WEIGHT = 0.8  # EAGLE-3's per-step loss decay over training-time-test steps
FEATURE_MODES = ("auto", "online", "stored")
ONLINE_HIDDEN_BUDGET = 1 << 28  # captured hidden-state elements per online target forward
ONLINE_PREFETCH_STEPS = 8  # training steps whose online features one round of forwards makes


@dataclasses.dataclass
class TrainConfig:
    """Options of :func:`train_drafter` (the CLI flags of ``treecompile train-drafter``)."""

    out: str
    prompts: int | None = None  # first N of the seeded prompt order; None = all
    max_new_tokens: int = 128
    gen_batch_size: int = 32
    samples_per_prompt: int = 1  # 1 greedy continuation per prompt, plus (n - 1) sampled ones
    temperature: float = 0.8  # of the sampled continuations (the greedy one is always there)
    steps: int = 1000
    batch_size: int = 8  # sequences per training step
    lr: float = 1e-3
    schedule_steps: int | None = None  # cosine horizon; default ``steps``
    warmup_steps: int = 20
    draft_vocab: int = 8192
    ttt_steps: int = 2  # extra training-time-test steps after step 0
    topk_targets: int = 8
    checkpoint_every: int = 50
    seed: int = 0
    resume: bool = False
    export_dtype: str = "float16"
    max_hours: float | None = None  # stop (checkpointed) after this much training wall time
    freeze_lm_head: bool = False  # keep the target's own output rows: fewer weights to overfit small data
    lm_head_int8: bool = False  # export the lm_head rows as int8 with a scale a row (a bigger draft vocabulary ships)
    weight_decay: float = 0.0
    features: str = "auto"  # "online": the target runs in each step; "stored": in the data; "auto": stored if it fits
    init_from: str | None = None  # warm start: an exported head's directory (its draft vocabulary and weights)

    def validate(self) -> None:
        for name in ("max_new_tokens", "gen_batch_size", "samples_per_prompt", "steps", "batch_size", "draft_vocab", "topk_targets",
                     "checkpoint_every"):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if self.prompts is not None and (not isinstance(self.prompts, int) or self.prompts < 1):
            raise ValueError(f"prompts: expected a positive int or None (all), got {self.prompts!r}")
        if not isinstance(self.ttt_steps, int) or not 0 <= self.ttt_steps <= 8:
            raise ValueError(f"ttt_steps: expected an int in 0..8, got {self.ttt_steps!r}")
        if not (isinstance(self.temperature, float) and 0 < self.temperature <= 2):
            raise ValueError(f"temperature: expected a float in (0, 2], got {self.temperature!r}")
        if not (isinstance(self.lr, float) and 0 < self.lr < 1):
            raise ValueError(f"lr: expected a float in (0, 1), got {self.lr!r}")
        if not (isinstance(self.weight_decay, float) and 0 <= self.weight_decay < 1):
            raise ValueError(f"weight_decay: expected a float in [0, 1), got {self.weight_decay!r}")
        if self.features not in FEATURE_MODES:
            raise ValueError(f"features: one of {', '.join(FEATURE_MODES)}; got {self.features!r}")
        if self.export_dtype not in ("float16", "bfloat16", "float32"):
            raise ValueError(f"export_dtype: one of float16, bfloat16, float32; got {self.export_dtype!r}")
        if self.max_hours is not None and not (
            isinstance(self.max_hours, (int, float)) and not isinstance(self.max_hours, bool) and self.max_hours > 0
        ):
            raise ValueError(f"max_hours: expected a positive number of hours or None, got {self.max_hours!r}")
        if self.init_from is not None and not (Path(self.init_from) / "config.json").is_file():
            raise ValueError(f"init_from: {self.init_from!r} has no config.json (expected an exported head directory)")
        if self.init_from is not None and Path(self.init_from).resolve() == Path(self.out).resolve():
            raise ValueError(f"init_from: {self.init_from!r} is also --out, whose checkpoints would overwrite the head "
                             "it starts from; pass another --out")  # fmt: skip
        if self.lm_head_int8 and self.freeze_lm_head:
            raise ValueError("lm_head_int8: a frozen lm_head (freeze_lm_head) is not shipped at all; drop one of them")


# ---------------------------------------------------------------------------------------------------
# Target and prompts
# ---------------------------------------------------------------------------------------------------


def load_target(target: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """``"smollm2"`` -> the embedded default (:func:`treecompile.models.load_smollm2`); anything else is an
    HF model directory or hub id read with ``AutoModelForCausalLM`` / ``AutoTokenizer``."""
    if target == "smollm2":
        from treecompile.models import load_smollm2

        return load_smollm2(dtype=dtype, device=device)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.path.isdir(target):
        logger.info("target %r is not a local directory; asking the HF hub for it", target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(target)
    return model, tokenizer


def chat_ids(tokenizer, prompt: str) -> list[int]:
    """Token ids of one user message as the target sees it: its chat template with the assistant turn
    opened when it has one, the bare prompt otherwise."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(prompt)["input_ids"])


def ordered_prompts(count: int | None, seed: int = 0) -> list[str]:
    """The first ``count`` training prompts in a seeded order (all when None): a subset spans every
    category, and a larger ``count`` extends a smaller one, so cached shards stay valid."""
    from treecompile.prompts import training_prompts

    prompts = training_prompts()
    order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(seed)).tolist()
    chosen = [prompts[i] for i in order]
    return chosen if count is None else chosen[:count]


def _eos_ids(model, tokenizer) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


# ---------------------------------------------------------------------------------------------------
# Stage 1: self-distilled data
# ---------------------------------------------------------------------------------------------------


class _TopKRecorder:
    """A logits processor that records the target's top-k log-probs of every generated position and
    leaves the scores untouched (greedy picks the same token). The steps stay on the target's device until
    :meth:`stacked` (a copy to the host a step would wait for the device every step)."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.steps: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, input_ids, scores):
        logp = torch.log_softmax(scores.float(), dim=-1)
        top = logp.topk(self.k, dim=-1)
        self.steps.append((top.indices.to(torch.int32), top.values.to(torch.float16)))
        return scores

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids int32 [B, steps, k], logp float16 [B, steps, k])`` on the host."""
        return tuple(torch.stack([s[i] for s in self.steps], dim=1).cpu() for i in range(2))


class _Temper:
    """Divides the scores by a temperature. It sits after :class:`_TopKRecorder` in the processor list, so
    the recorded targets are the target's own distribution; only the sampled token is tempered."""

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature

    def __call__(self, input_ids, scores):
        return scores / self.temperature


def _generate_shard(model, prompt_ids: list[list[int]], max_new_tokens, aux_layers, topk, eos, pad,
                    temperature: float | None = None, seed: int = 0, features: bool = True) -> list[dict]:  # fmt: skip
    """One batch of continuations: greedy when ``temperature`` is None, else sampled at that temperature
    (seeded by ``seed``).

    Returns one record per prompt: ``tokens int32 [n]`` (prompt + continuation, cut after the first EOS),
    ``prompt_len L``, ``target_ids int32 [m, k]`` / ``target_logp float16 [m, k]`` (the target's top-k at
    positions L-1 .. n-2, i.e. for generated tokens 0..m-1; m = n - L; the untempered distribution even where
    the token was sampled), and with ``features`` (``--features stored``) ``features float16 [n - 1, F]``
    (aux hidden states of positions 0..n-2; float32 when they overflow float16).
    """
    from transformers import LogitsProcessorList

    device = next(model.parameters()).device
    B, width = len(prompt_ids), max(len(p) for p in prompt_ids)
    ids = torch.full((B, width), pad, dtype=torch.long)
    mask = torch.zeros(B, width, dtype=torch.long)
    for b, p in enumerate(prompt_ids):  # left padding, as HF decoder-only generate wants
        ids[b, width - len(p):] = torch.tensor(p)
        mask[b, width - len(p):] = 1
    recorder = _TopKRecorder(topk)
    processors = [recorder]
    sampling = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    if temperature is not None:
        # HF's own warpers stay off (temperature 1, no top-k/top-p): the tempering is ours, after the recorder.
        processors.append(_Temper(temperature))
        sampling = {"do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0}
        torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
            num_beams=1, **sampling, logits_processor=LogitsProcessorList(processors),
            return_dict_in_generate=True, eos_token_id=eos or None, pad_token_id=pad,
        )  # fmt: skip
    gen = out.sequences[:, width:].cpu()
    top_ids, top_logp = recorder.stacked()  # [B, steps, k]
    records = []
    for b, p in enumerate(prompt_ids):
        row = _until_eos(gen[b].tolist(), eos)
        L, m = len(p), len(row)
        tokens = torch.tensor(p + row, dtype=torch.int32)
        records.append({"tokens": tokens, "prompt_len": L, "target_ids": top_ids[b, :m].clone(),
                        "target_logp": top_logp[b, :m].clone()})  # fmt: skip
    if features:
        _stored_features(model, records, aux_layers)
    return records


def _stored_features(model, records: list[dict], aux_layers, rows_a_call: int = 256) -> None:
    """Adds ``features [n - 1, F]`` (aux hidden states of positions 0..n-2) to each finished record, from
    parallel forwards of the target over the whole sequences (:func:`_online_features`, rows of similar
    length together so little is padding, at most :data:`ONLINE_HIDDEN_BUDGET` elements a group); float16
    unless a value overflows it, then that record keeps float32. Rounding and the overflow test run on the
    target's device, with one wait a group; each record gets its own host copy.

    Why not ``generate(output_hidden_states=True)``, which has the same states at hand: it keeps every
    layer's state of every step and copies the aux ones to the host a step at a time. On the H200 at
    SmolLM2's shape, 3072 rows x 64 sampled steps took 9.2-14.9 s that way (the probe's first variant pays a
    warm-up) against 4.9 s without the states and 2.7-2.8 s for a forward over the finished rows that forms
    all logits too, which this one does not (``tests/gpu/gen_probe.py``). A whole data stage went from 83 to
    59 us a generated token (thirty-third and thirty-fourth sessions; different prompt sets). The values are
    the same up to rounding: the
    states a causal forward computes do not depend on the positions after them (float64 test)."""
    here = next(model.parameters()).device
    F = len(aux_layers) * int(model.config.hidden_size)
    order = sorted(range(len(records)), key=lambda i: len(records[i]["tokens"]))
    wide, start = False, 0
    while start < len(order):
        longest = len(records[order[min(start + rows_a_call, len(order)) - 1]]["tokens"]) - 1  # sorted: the last
        group = order[start : start + max(1, min(rows_a_call, ONLINE_HIDDEN_BUDGET // max(longest * F, 1)))]
        start += len(group)
        (full,) = _online_features(model, records, [group], aux_layers, here)  # [g, T, F] float32, padded
        # float16 halves the data; hidden-state outliers (SmolLM2's reach ~25k) must still fit its range.
        small = full.to(torch.float16)
        lengths = torch.tensor([len(records[i]["tokens"]) - 1 for i in group], device=here)
        seen = torch.arange(full.shape[1], device=here)[None, :] < lengths[:, None]  # [g, T]: not padding
        overflow = ((~torch.isfinite(small) & torch.isfinite(full)).any(-1) & seen).any(-1).tolist()
        for r, i in enumerate(group):
            src = full if overflow[r] else small
            # A copy of the row alone: torch.save writes a view's whole storage.
            records[i]["features"] = src[r, : len(records[i]["tokens"]) - 1].to("cpu", copy=True)
        wide = wide or any(overflow)
    if wide:
        logger.warning("hidden states exceed the float16 range; the records they occur in keep float32 features")


def _until_eos(row: list[int], eos: list[int]) -> list[int]:
    """A continuation cut after its first EOS (kept), as a request stops there."""
    for j, t in enumerate(row):
        if t in eos:
            return row[: j + 1]
    return row


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)  # a shard or checkpoint appears whole or not at all


def _resolve_features(cfg: TrainConfig, model, tokenizer, prompts: list[str], data_dir: Path, aux_layers) -> str:
    """``--features auto`` -> ``stored`` or ``online``. Data already in ``data_dir`` keeps the mode it was
    made with; otherwise ``stored`` when its upper bound (every continuation at ``max_new_tokens``, float16
    features) fits a quarter of the host memory (all records are held there while training) and half the
    free disk, since stored features train fastest: the eighteenth session's probe at SmolLM2's shape on
    the H200 read 0.075 s a training step stored against 0.177 online (``tests/gpu/probe25.sh``)."""
    if cfg.features != "auto":
        return cfg.features
    meta = data_dir / "meta.json"
    if meta.is_file():
        mode = "online" if json.loads(meta.read_text()).get("features") == "online" else "stored"
        logger.info("features: %s, as the data in %s were made", mode, data_dir)
        return mode
    tokens = sum(len(chat_ids(tokenizer, p)) + cfg.max_new_tokens for p in prompts) * cfg.samples_per_prompt
    need = tokens * len(aux_layers) * int(model.config.hidden_size) * 2
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows): the disk alone decides
        memory = float("inf")
    disk = shutil.disk_usage(data_dir.parent if not data_dir.exists() else data_dir).free
    mode = "stored" if need <= min(memory / 4, disk / 2) else "online"
    logger.info("features: %s (stored ones would take up to %.1f GB; a quarter of memory %.1f GB, half the free "
                "disk %.1f GB)", mode, need / 1e9, memory / 4e9, disk / 2e9)  # fmt: skip
    return mode


def _data_identity(model, target_name: str, cfg: TrainConfig, aux_layers) -> dict:
    identity = {
        "format": DATA_FORMAT,
        "target": target_name,
        "vocab_size": int(model.config.vocab_size),
        "hidden_size": int(model.config.hidden_size),
        "num_hidden_layers": int(model.config.num_hidden_layers),
        "aux_layers": list(aux_layers),
        "max_new_tokens": cfg.max_new_tokens,
        "topk_targets": cfg.topk_targets,
        "prompt_seed": cfg.seed,
    }
    if cfg.features == "online":
        # No features in the shards, so the aux layers are not part of the data. (Stored data keeps the
        # identity it always had, so earlier data directories stay valid.)
        del identity["aux_layers"]
        identity["features"] = "online"
    return identity


def generate_data(model, tokenizer, prompts: list[str], data_dir: Path, identity: dict, max_new_tokens: int,
                  batch_size: int, aux_layers, topk: int, progress: bool = True, samples_per_prompt: int = 1,
                  temperature: float = 0.8, seed: int = 0, features: bool = True) -> list[Path]:  # fmt: skip
    """Stage 1: shards over ``prompts`` in order, ``batch_size`` prompts each: ``gen_<start>_<stop>.pt``
    with the greedy continuations, then for each extra sample s = 1 .. ``samples_per_prompt`` - 1
    ``gen_s<s>_<start>_<stop>.pt`` with continuations sampled at ``temperature`` (more data from the same
    prompts; the recorded targets are the target's own distribution either way). ``features=False`` (online
    features) leaves the hidden states out (:func:`_generate_shard`).

    A shard whose file exists and holds the same prompts (and sample temperature) is reused (finished work
    survives an interruption, and a run with more samples extends one with fewer); ``data_dir/meta.json``
    pins what the shards were generated with, and a mismatch is a ValueError rather than a silent mix of
    incompatible data.
    """
    from tqdm.auto import tqdm

    data_dir.mkdir(parents=True, exist_ok=True)
    meta_path = data_dir / "meta.json"
    if meta_path.is_file():
        previous = json.loads(meta_path.read_text())
        if previous != identity:
            changed = sorted(k for k in set(previous) | set(identity) if previous.get(k) != identity.get(k))
            raise ValueError(
                f"out: {data_dir} holds data generated with other settings ({', '.join(changed)}: "
                f"{[previous.get(k) for k in changed]} != {[identity.get(k) for k in changed]}); use another --out "
                f"or delete {data_dir}"
            )
    else:
        meta_path.write_text(json.dumps(identity, indent=1))
    eos = _eos_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    spans = [(s, min(s + batch_size, len(prompts))) for s in range(0, len(prompts), batch_size)]
    paths, todo = [], []
    for sample in range(samples_per_prompt):
        temp = None if sample == 0 else float(temperature)
        prefix = "gen" if sample == 0 else f"gen_s{sample}"
        for start, stop in spans:
            path = data_dir / f"{prefix}_{start:05d}_{stop:05d}.pt"
            paths.append(path)
            if path.is_file():
                try:
                    shard = torch.load(path, weights_only=True)
                    if shard["prompts"] == prompts[start:stop] and shard.get("temperature") == temp:
                        continue
                except Exception as exc:  # a damaged shard is regenerated, never trusted
                    logger.warning("data shard %s unreadable (%s); regenerating it", path, exc)
            todo.append((start, stop, path, sample, temp))
    if len(todo) < len(paths):
        logger.info("data: %d of %d shards already generated; %d to go", len(paths) - len(todo), len(paths), len(todo))
    calls = _group_samples(todo, batch_size)
    bar = tqdm(calls, desc="generating", unit="batch", disable=not progress)
    tokens_done = 0
    for group in bar:
        start, stop, _, sample, temp = group[0]
        batch = prompts[start:stop]
        t0 = time.perf_counter()
        records = _generate_shard(model, [chat_ids(tokenizer, p) for p in batch] * len(group), max_new_tokens,
                                  aux_layers, topk, eos, pad, temperature=temp,
                                  seed=seed * 1_000_003 + sample * 10_007 + start, features=features)  # fmt: skip
        tokens_done += sum(_generated(r) for r in records)
        seconds = (time.perf_counter() - t0) / len(group)
        for i, (_, _, path, _, _) in enumerate(group):  # one shard per sample, as if generated alone
            part = records[i * len(batch) : (i + 1) * len(batch)]
            _atomic_save({"prompts": batch, "temperature": temp, "records": part, "seconds": seconds}, path)
        bar.set_postfix(generated_tokens=tokens_done)
    return paths


def _group_samples(todo: list[tuple], batch_size: int) -> list[list[tuple]]:
    """Shards to generate -> ``generate`` calls: sampled shards of the same prompts share a call, as many as
    fit ``batch_size`` rows. ``generate`` costs about the same per step at any batch an H200 holds for a
    small target (host-bound: ~47 ms a step for SmolLM2 at 757 rows, fifth session), so with fewer prompts
    than ``batch_size`` one call makes several samples' shards. The greedy shards stay one a call (their
    rows would all be alike). A group's sampling seed is its first sample's, so the sampled data depend on
    ``batch_size`` too."""
    calls, pending = [], {}
    for item in todo:
        start, stop, _, _, temp = item
        if temp is None:
            calls.append([item])
            continue
        group = pending.setdefault((start, stop), [])
        group.append(item)
        if len(group) * (stop - start) + (stop - start) > batch_size:  # the next one would not fit
            calls.append(pending.pop((start, stop)))
    calls.extend(pending.values())
    return calls


def _generated(record: dict) -> int:
    return len(record["tokens"]) - record["prompt_len"]


def load_records(paths: list[Path]) -> tuple[list[dict], float]:
    """All shards' records, and the generation seconds they took (over every run that made them)."""
    records, seconds = [], 0.0
    for path in paths:
        shard = torch.load(path, weights_only=True)
        records.extend(shard["records"])
        seconds += float(shard.get("seconds", float("nan")))
    return records, seconds


# ---------------------------------------------------------------------------------------------------
# Stage 2: draft vocabulary
# ---------------------------------------------------------------------------------------------------


def _vocab_score(records: list[dict], vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(score [V], generated counts [V])`` float64: one sort key for draft-vocabulary membership, the generated
    count first, then the count among the target's recorded top-k alternatives, then the lower id."""
    generated = torch.zeros(vocab_size, dtype=torch.float64)
    alternatives = torch.zeros(vocab_size, dtype=torch.float64)
    for r in records:
        L = r["prompt_len"]
        generated += torch.bincount(r["tokens"][L:].long(), minlength=vocab_size).double()
        alternatives += torch.bincount(r["target_ids"].flatten().long(), minlength=vocab_size).double()
    ids = torch.arange(vocab_size, dtype=torch.float64)
    return generated * 1e12 + alternatives * 1e3 + (1 - ids / vocab_size), generated


def build_draft_vocab(records: list[dict], vocab_size: int, draft_vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``draft_vocab`` most frequent generated tokens (ties to the lower id); when fewer distinct ones
    occur, the target's most frequent top-k alternatives fill up, then the lowest unused ids.

    Returns ``(draft_ids int64 [Vd] ascending, d2t int64 [Vd], t2d bool [V])`` with
    ``draft_ids = arange(Vd) + d2t`` (EAGLE-3's offsets).
    """
    if not 1 <= draft_vocab <= vocab_size:
        raise ValueError(f"draft_vocab: must be in 1..{vocab_size} (the target's vocabulary), got {draft_vocab}")
    score, generated = _vocab_score(records, vocab_size)
    draft_ids = torch.sort(torch.topk(score, draft_vocab).indices).values
    d2t = draft_ids - torch.arange(draft_vocab)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    covered = float(generated[draft_ids].sum() / generated.sum().clamp(min=1))
    logger.info("draft vocabulary: %d ids cover %.2f%% of the %d generated tokens (%d distinct)", draft_vocab,
                100 * covered, int(generated.sum()), int((generated > 0).sum()))  # fmt: skip
    return draft_ids, d2t, t2d


# ---------------------------------------------------------------------------------------------------
# The head and its training forward
# ---------------------------------------------------------------------------------------------------


def init_head(model, draft_ids: torch.Tensor, seed: int = 0):
    """A fresh float32 :class:`EagleDrafter` for ``model`` over ``draft_ids``: random ``fc`` and midlayer,
    ``lm_head`` rows and ``norm`` copied from the target (the head learns to produce a state the target's
    own output layer reads)."""
    from treecompile.drafter import EagleDrafter, target_lm_head_rows

    head = EagleDrafter.for_target(model, seed=seed, draft_vocab_size=len(draft_ids)).float()
    with torch.no_grad():
        head.d2t.copy_(draft_ids - torch.arange(len(draft_ids)))
        head.t2d.zero_()
        head.t2d[draft_ids] = True
        out = model.get_output_embeddings()
        if out is not None and out.weight.shape[1] == head.hidden_size:
            head.lm_head.weight.copy_(target_lm_head_rows(model, head.d2t, head.hidden_size).float().cpu())
        final_norm = getattr(getattr(model, "model", None), "norm", None)
        if final_norm is not None and getattr(final_norm, "weight", None) is not None:
            head.norm.weight.copy_(final_norm.weight.detach().float().cpu())
        # Start the midlayer's residual branches small: the fused state passes through at first.
        head.midlayer.self_attn.o_proj.weight.mul_(0.1)
        head.midlayer.mlp.down_proj.weight.mul_(0.1)
    return head


def warm_head(path: str, model, aux_layers, draft_vocab: int, records: list[dict] | None = None, seed: int = 0):
    """An exported head (``path``: config.json + weights, as :func:`export_head` writes them) as the float32
    head to train on: training goes on from its weights over its own draft vocabulary, so new data and more
    steps can add to a head across sessions (the optimizer state starts afresh; a lower ``--lr`` suits).

    A larger ``draft_vocab`` grows the vocabulary: the head keeps every id it has (and its lm_head row), and the
    ids this run's ``records`` generate most (:func:`build_draft_vocab`'s order) join with the target's own
    output rows carried into the head's row space (:func:`_grown_head`). Held-out greedy tokens outside a
    12288-id vocabulary stop about one path in seven short (twentieth session, BENCHMARKS.md). Refused unless
    its fused layers are this run's and ``draft_vocab`` is at least its vocabulary."""
    from treecompile.drafter import EagleDrafter

    head = EagleDrafter.from_pretrained(path, model, dtype=torch.float32, device="cpu")
    if tuple(head.aux_layers) != tuple(aux_layers):
        raise ValueError(f"init_from: the head fuses hidden states {tuple(head.aux_layers)}, this run {tuple(aux_layers)}")
    have = head.draft_vocab_size
    if draft_vocab < have:
        raise ValueError(
            f"init_from: the head has {have} draft ids, --draft-vocab is {draft_vocab}; pass --draft-vocab {have} "
            "(or more, to grow it)"
        )
    if draft_vocab > have:
        if records is None:
            raise ValueError("init_from: growing the draft vocabulary needs the run's data (records)")
        head = _grown_head(head, model, draft_vocab, records, seed)
        logger.info("warm start from %s: draft vocabulary %d -> %d ids (new lm_head rows: the target's, mapped into "
                    "the head's)", path, have, draft_vocab)  # fmt: skip
    else:
        logger.info("warm start from %s (%d draft ids)", path, have)
    return head


def _grown_head(head, model, draft_vocab: int, records: list[dict], seed: int):
    """``head`` over a larger draft vocabulary: its ids plus the most generated others (module :func:`warm_head`)."""
    vocab = model.config.vocab_size
    if draft_vocab > vocab:
        raise ValueError(f"draft_vocab: must be in 1..{vocab} (the target's vocabulary), got {draft_vocab}")
    old_ids = torch.arange(head.draft_vocab_size) + head.d2t.cpu()
    score, _ = _vocab_score(records, vocab)  # build_draft_vocab's key, over the ids the head lacks
    score[old_ids] = -1.0
    new_ids = torch.topk(score, draft_vocab - len(old_ids)).indices
    draft_ids = torch.sort(torch.cat([old_ids, new_ids])).values
    grown = init_head(model, draft_ids, seed=seed)  # target rows for every id; the head's weights replace the rest
    old_state = {k: v for k, v in head.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")}
    try:
        missing, unexpected = grown.load_state_dict(old_state, strict=False)
    except RuntimeError as exc:  # a shape that differs from a head sized for this target
        raise ValueError(f"init_from: the head is not shaped like a fresh head for this target: {exc}") from None
    if unexpected or not set(missing) <= {"lm_head.weight", "d2t", "t2d"}:
        raise ValueError(f"init_from: the head's weights do not fit a grown head: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        position = torch.searchsorted(draft_ids, old_ids)  # where each old id sits in the grown vocabulary
        old_rows = head.lm_head.weight.detach().float()
        added = torch.ones(draft_vocab, dtype=torch.bool)
        added[position] = False
        target_rows = grown.lm_head.weight.detach().clone()  # init_head's: the target's own rows (when it has them)
        if old_rows.shape[0] >= old_rows.shape[1]:
            # A trained head's rows drift from the target's (SmolLM2's shipped head: cosine 0.84, norm 0.96x), so a
            # raw target row scores its token on another scale than its trained neighbours and steals the top-1 (a
            # grown head's training-batch agreement fell 0.80 -> 0.34 before any step). The least-squares linear
            # map from the target's rows of the old ids to their trained rows (residual 0.31 of the rows' norm
            # there, against 0.54 for the best single scale) carries the new rows into the trained space.
            old_target = target_rows[position].double()
            mapping = torch.linalg.lstsq(old_target, old_rows.double()).solution
            grown.lm_head.weight[added] = (target_rows[added].double() @ mapping).float()
        grown.lm_head.weight[position] = old_rows
    return grown


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _qkv(head, hidden, tokens, positions):
    """The midlayer's projections for rows ``hidden [B, T, H]`` / ``tokens, positions [B, T]`` ->
    ``q [B, Hkv, g, T, D]``, ``k, v [B, Hkv, 1, T, D]`` (RoPE applied; g query heads per KV head)."""
    layer, attn = head.midlayer, head.midlayer.self_attn
    B, T, _ = hidden.shape
    embeds = head.embed(tokens).to(hidden.dtype)
    x = torch.cat((layer.input_layernorm(embeds), layer.hidden_norm(hidden)), dim=-1)
    hkv, g, d = attn.num_kv_heads, attn.num_heads // attn.num_kv_heads, attn.head_dim
    q = attn.q_proj(x).view(B, T, hkv, g, d).permute(0, 2, 3, 1, 4)
    k = attn.k_proj(x).view(B, T, hkv, 1, d).permute(0, 2, 3, 1, 4)
    v = attn.v_proj(x).view(B, T, hkv, 1, d).permute(0, 2, 3, 1, 4)
    cos, sin = head.rotary_emb(hidden, positions)  # [B, T, D]
    cos, sin = cos[:, None, None].to(hidden.dtype), sin[:, None, None].to(hidden.dtype)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v


def _finish(head, hidden, attn_out):
    """Residual, o_proj and MLP after attention: ``attn_out [B, Hkv, g, T, D] -> [B, T, H]``."""
    layer, attn = head.midlayer, head.midlayer.self_attn
    B, T = hidden.shape[:2]
    h = hidden + attn.o_proj(attn_out.permute(0, 3, 1, 2, 4).reshape(B, T, attn.num_heads * attn.head_dim))
    return h + layer.mlp(layer.post_attention_layernorm(h))


def ttt_forward(head, features: torch.Tensor, tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The head's outputs over a batch of sequences for training-time-test steps 0..``steps``.

    features : [B, T, F]   fused-state inputs of pair positions 0..T-1
    tokens : [B, T + steps + 1]  the sequence (token at p + 1 pairs with position p)

    Returns ``[out_0, ..., out_steps]``, each ``[B, T, H]`` (pre-norm; ``head.logits`` reads it): row b of
    step j is what a lane row at depth j computes for the round whose step-0 row sat at position b
    (position b + j, token ``tokens[b + j + 1]``, hidden = step j-1's row b, attending to the step-0 keys
    of positions <= b and to its own keys of steps 1..j).
    """
    B, T, _ = features.shape
    attn = head.midlayer.self_attn
    positions = torch.arange(T, device=features.device).expand(B, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=features.device).tril()
    hidden = head.project(features)
    q, k0, v0 = _qkv(head, hidden, tokens[:, 1 : T + 1], positions)
    scores = (q @ k0.transpose(-1, -2)) * attn.scaling  # [B, Hkv, g, T, T]
    probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    outs = [_finish(head, hidden, probs @ v0)]
    chain: list[tuple[torch.Tensor, torch.Tensor]] = []
    for j in range(1, steps + 1):
        hidden = outs[-1]
        q, kj, vj = _qkv(head, hidden, tokens[:, j + 1 : T + j + 1], positions + j)
        chain.append((kj, vj))
        base = (q @ k0.transpose(-1, -2)) * attn.scaling
        base = base.masked_fill(~causal, float("-inf"))
        # Each row's own chain keys sit on the diagonal: one score per earlier step (and this one).
        diag = [((q * kc).sum(-1, keepdim=True)) * attn.scaling for kc, _ in chain]
        probs = torch.softmax(torch.cat([base] + diag, dim=-1), dim=-1)
        out = probs[..., :T] @ v0
        for i, (_, vc) in enumerate(chain):
            out = out + probs[..., T + i : T + i + 1] * vc
        outs.append(_finish(head, hidden, out))
    return outs


# ---------------------------------------------------------------------------------------------------
# Stage 3: training
# ---------------------------------------------------------------------------------------------------


def _batches(records: list[dict], batch_size: int) -> list[list[int]]:
    """Sequences grouped by length (little padding), batch order shuffled per epoch by :func:`_batch_at`."""
    order = sorted(range(len(records)), key=lambda i: (len(records[i]["tokens"]), i))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def _batch_at(batches: list[list[int]], step: int, seed: int) -> list[int]:
    # A pure function of the step: a resumed run draws exactly the batches an uninterrupted one would.
    epoch, index = divmod(step, len(batches))
    perm = torch.randperm(len(batches), generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    return batches[int(perm[index])]


def _collate(records: list[dict], idx: list[int], t2d_index: torch.Tensor, steps: int, device, online: bool = False):
    """Padded tensors of one batch: features [B, T, F] (None when ``online``: :func:`_online_features`
    makes them), tokens [B, T + steps + 1], and per absolute position q (predicting the token at q + 1) the
    draft-vocabulary soft target ``target [B, T + steps + 1, k]`` (draft ids, -1 where absent) with
    probabilities ``target_p``."""
    recs = [records[i] for i in idx]
    B = len(recs)
    T = max(len(r["tokens"]) for r in recs) - 1
    k = recs[0]["target_ids"].shape[1]
    feats = None if online else torch.zeros(B, T, recs[0]["features"].shape[1], dtype=torch.float32)
    tokens = torch.zeros(B, T + steps + 1, dtype=torch.long)
    tgt = torch.full((B, T + steps + 1, k), -1, dtype=torch.long)
    tgt_p = torch.zeros(B, T + steps + 1, k, dtype=torch.float32)
    for b, r in enumerate(recs):
        n, L = len(r["tokens"]), r["prompt_len"]
        if feats is not None:
            feats[b, : n - 1] = r["features"].float()
        tokens[b, :n] = r["tokens"].long()
        m = len(r["target_ids"])
        draft = t2d_index[r["target_ids"].long()]  # [m, k], -1 outside the draft vocabulary
        p = r["target_logp"].float().exp() * (draft >= 0)
        p = p / p.sum(-1, keepdim=True).clamp(min=1e-12)
        tgt[b, L - 1 : L - 1 + m] = torch.where(p.sum(-1, keepdim=True) > 0, draft, -1)
        tgt_p[b, L - 1 : L - 1 + m] = p
    return None if feats is None else feats.to(device), tokens.to(device), tgt.to(device), tgt_p.to(device)


def _online_features(model, records: list[dict], batches: list[list[int]], aux_layers, device) -> list[torch.Tensor]:
    """``features [B_i, T_i, F]`` for each batch of ``batches`` (``--features online``): the aux hidden
    states ``generate`` would have recorded, from parallel forwards of the target over each sequence's pair
    positions 0..T-1, right-padded (a causal row never sees the pad after it; padded rows are never read).

    Several training steps' batches share each forward (the training loop passes
    :data:`ONLINE_PREFETCH_STEPS` at a time): at a small target's size a forward's cost is mostly the host's
    per-layer overhead, not its rows (the eighteenth session's probe: 0.1 s a step for one SmolLM2-shaped
    forward of 32 rows). Forwards hold at most :data:`ONLINE_HIDDEN_BUDGET` captured elements; the aux layers'
    outputs are caught by forward hooks on the decoder layers (HF ``hidden_states[i]`` is layer i-1's
    output), so the other layers' states are never kept, and only the last position's logits are formed.
    Models whose layers cannot be found that way fall back to ``output_hidden_states``."""
    rows = [i for idx in batches for i in idx]
    T = max(len(records[i]["tokens"]) for i in rows) - 1
    tokens = torch.zeros(len(rows), T, dtype=torch.long)
    for b, i in enumerate(rows):
        tokens[b, : len(records[i]["tokens"]) - 1] = records[i]["tokens"][:-1].long()
    here = next(model.parameters()).device  # the target's device; the features go to ``device``
    layers = _decoder_layers(model, aux_layers)
    hooks_ok = layers is not None
    per_row = T * int(model.config.hidden_size) * (len(aux_layers) if hooks_ok else int(model.config.num_hidden_layers) + 1)
    step = max(1, ONLINE_HIDDEN_BUDGET // max(per_row, 1))
    feats = []
    with torch.no_grad():
        for start in range(0, len(rows), step):
            x = tokens[start : start + step].to(here)
            if hooks_ok:
                caught: dict[int, torch.Tensor] = {}
                handles = [
                    layers[i - 1].register_forward_hook(
                        lambda _m, _a, out, i=i: caught.__setitem__(i, out[0] if isinstance(out, tuple) else out))
                    for i in sorted(set(aux_layers))
                ]  # fmt: skip
                try:
                    model(input_ids=x, logits_to_keep=1)
                finally:
                    for h in handles:
                        h.remove()
                states = [caught[i] for i in aux_layers]
            else:
                out = model(input_ids=x, output_hidden_states=True, logits_to_keep=1)
                states = [out.hidden_states[i] for i in aux_layers]
            feats.append(torch.cat(states, dim=-1).to(device, torch.float32))
    feats = torch.cat(feats)
    out, at = [], 0
    for idx in batches:
        t = max(len(records[i]["tokens"]) for i in idx) - 1
        out.append(feats[at : at + len(idx), :t])
        at += len(idx)
    return out


def _decoder_layers(model, aux_layers):
    """The target's decoder layer list when every aux index i names layer i-1's output (1 <= i < the layer
    count: index 0 is the embeddings and the last is the normed output in HF's ``hidden_states``), else None."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if layers is None or len(layers) != int(model.config.num_hidden_layers):
        return None
    return layers if all(1 <= i < len(layers) for i in aux_layers) else None


def _step_loss(head, outs, tgt, tgt_p):
    """Weighted soft cross-entropy over TTT steps; also each step's top-1 agreement with the target.

    Returns ``(loss, losses, accs)``: the loss tensor (None when no position of the batch has a target)
    and per step the mean cross-entropy and agreement (NaN for a step with no target). Every row's logits
    are formed and the rows without a target weighted 0, rather than selecting rows with a boolean mask:
    that would read the mask's count back to the host once per step; here one read per training step
    brings every number back."""
    total, stats = 0.0, []
    T = outs[0].shape[1]
    for j, out in enumerate(outs):
        # Step j's row b predicts the token after absolute position b + j + 1.
        t, p = tgt[:, j + 1 : j + 1 + T], tgt_p[:, j + 1 : j + 1 + T]
        valid = t[..., 0] >= 0  # [B, T]
        count = valid.sum()
        logp = torch.log_softmax(head.logits(out).float(), dim=-1)  # [B, T, Vd]
        rows = -(p * logp.gather(-1, t.clamp(min=0))).sum(-1)  # 0 where p is (no target)
        ce = (rows * valid).sum() / count.clamp(min=1)
        total = total + (STEP_WEIGHT**j) * ce
        acc = ((logp.argmax(-1) == t[..., 0]) & valid).sum() / count.clamp(min=1)
        stats.append(torch.stack([ce.detach(), acc.float(), count.float()]))
    values = torch.stack(stats).tolist()  # the step's one host read
    losses = [ce if n > 0 else float("nan") for ce, _, n in values]
    accs = [acc if n > 0 else float("nan") for _, acc, n in values]
    return (total if any(n > 0 for *_, n in values) else None), losses, accs


def _lr_at(step: int, cfg: TrainConfig) -> float:
    horizon = max(cfg.schedule_steps or cfg.steps, 1)
    warm = min(cfg.warmup_steps, max(horizon // 10, 1))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    frac = min((step - warm) / max(horizon - warm, 1), 1.0)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def _trainable(head) -> list[nn.Parameter]:
    # The token embedding is the target's (shared, frozen); everything the head owns trains.
    return [p for p in head.parameters() if p.requires_grad]


def quantize_rows_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [V, H]`` -> (int8 ``[V, H]``, float32 scale ``[V]``), symmetric a row: ``q * scale`` is the
    weight to within half a step of its row's absmax / 127. An all-zero row gets scale 1 (q = 0)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def export_head(head, out_dir: Path, dtype: str = "float16", lm_head_from: torch.nn.Module | None = None,
                lm_head_int8: bool = False) -> None:
    """Write ``config.json`` + ``model.safetensors`` in the public EAGLE-3 layout.

    ``lm_head_from``: the target, when the head's lm_head is the target's own output rows over the draft
    vocabulary (``--freeze-lm-head``). Those rows are then left out of the file and the config says
    ``"lm_head_from_target": true``; :meth:`EagleDrafter.from_pretrained` takes them from the target again, so
    the draft vocabulary adds nothing to what ships. A head whose lm_head differs from the target's rows is
    refused (it would not load back to itself).

    ``lm_head_int8``: write ``lm_head.weight`` [V, H] as int8 with ``lm_head.weight_scale`` [V] (float32, a row's
    absmax / 127; config ``"lm_head_int8": true``), so the rows cost 1 byte a weight instead of 2 and a larger
    draft vocabulary fits a size budget. :meth:`EagleDrafter.from_pretrained` dequantizes them. Not the public
    layout: tools other than treecompile read such a head only after dequantizing."""
    from safetensors.torch import save_file

    if lm_head_int8 and lm_head_from is not None:
        raise ValueError("lm_head_int8: the lm_head is taken from the target (lm_head_from), so none is written")
    out_dir.mkdir(parents=True, exist_ok=True)
    cast = getattr(torch, dtype)
    if lm_head_from is not None:
        from treecompile.drafter import target_lm_head_rows

        rows = target_lm_head_rows(lm_head_from, head.d2t, head.hidden_size)
        if not torch.equal(rows.float().cpu(), head.lm_head.weight.detach().float().cpu()):
            raise ValueError("lm_head_from: the head's lm_head is not the target's output rows over its draft "
                             "vocabulary (was it trained?); export it with its lm_head instead")  # fmt: skip
    state = {}
    for name, t in head.state_dict().items():
        if name.startswith("rotary_emb") or name.startswith("embed_tokens"):
            continue
        if lm_head_from is not None and name == "lm_head.weight":
            continue
        t = t.detach().cpu()
        if lm_head_int8 and name == "lm_head.weight":
            state[name], state["lm_head.weight_scale"] = quantize_rows_int8(t)
            continue
        state[name] = (t.to(cast) if t.is_floating_point() else t).contiguous()
    config = head.config.to_dict()
    config.update({
        "architectures": ["LlamaForCausalLMEagle3"],
        "draft_vocab_size": head.draft_vocab_size,
        "target_hidden_size": head.target_hidden_size,
        # EAGLE-3 names layer outputs; HF hidden_states index i is the output of layer i - 1.
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in head.aux_layers]},
        "torch_dtype": dtype,
    })  # fmt: skip
    config.pop("lm_head_from_target", None)
    config.pop("lm_head_int8", None)
    if lm_head_from is not None:
        config["lm_head_from_target"] = True
    if lm_head_int8:
        config["lm_head_int8"] = True
    config.pop("dtype", None)
    tmp = out_dir / f".model.safetensors.tmp-{os.getpid()}"
    save_file(state, str(tmp))
    os.chmod(tmp, 0o644)  # an ordinary data file (the writer creates it owner-only)
    os.replace(tmp, out_dir / "model.safetensors")
    (out_dir / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))


def train_drafter(cfg: TrainConfig, model=None, tokenizer=None, target_name: str = "smollm2",
                  device: str | torch.device = "cpu", progress: bool = True, argv: list[str] | None = None) -> dict:  # fmt: skip
    """Run the three stages into ``cfg.out`` and return the training summary (also ``training.json``).

    ``model`` / ``tokenizer`` default to :func:`load_target` of ``target_name``. Refuses to start over an
    existing checkpoint unless ``cfg.resume``; with ``cfg.resume`` and no checkpoint, refuses too.
    """
    from tqdm.auto import tqdm

    from treecompile.drafter import default_aux_layers

    cfg.validate()
    out = Path(cfg.out)
    ckpt_path = out / CHECKPOINT
    if cfg.resume and not ckpt_path.is_file():
        raise ValueError(f"resume: {out} has no {CHECKPOINT} to resume from")
    if not cfg.resume and ckpt_path.is_file():
        raise ValueError(f"out: {out} already has a {CHECKPOINT}; pass --resume to continue it or pick another --out")
    device = torch.device(device)
    if model is None:
        gen_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model, tokenizer = load_target(target_name, device=device, dtype=gen_dtype)
    vocab = int(model.config.vocab_size)
    if cfg.draft_vocab > vocab:
        raise ValueError(f"draft_vocab: must be in 1..{vocab} (the target's vocabulary), got {cfg.draft_vocab}")
    aux_layers = default_aux_layers(model.config.num_hidden_layers)
    out.mkdir(parents=True, exist_ok=True)

    prompts = ordered_prompts(cfg.prompts, cfg.seed)
    cfg = dataclasses.replace(cfg, features=_resolve_features(cfg, model, tokenizer, prompts, out / "data", aux_layers))
    identity = _data_identity(model, target_name, cfg, aux_layers)
    online = cfg.features == "online"
    shards = generate_data(model, tokenizer, prompts, out / "data", identity, cfg.max_new_tokens,
                           cfg.gen_batch_size, aux_layers, cfg.topk_targets, progress=progress,
                           samples_per_prompt=cfg.samples_per_prompt, temperature=cfg.temperature, seed=cfg.seed,
                           features=not online)  # fmt: skip
    records, t_data = load_records(shards)
    gen_tokens = sum(_generated(r) for r in records)
    logger.info("data: %d sequences, %d generated tokens, %d tokens in all", len(records), gen_tokens,
                sum(len(r["tokens"]) for r in records))  # fmt: skip

    state = torch.load(ckpt_path, weights_only=False) if cfg.resume else None
    warm, base = None, _base_training(cfg.init_from)
    if state is not None:
        draft_ids = state["draft_ids"]
        if tuple(state["aux_layers"]) != tuple(aux_layers):
            raise ValueError(f"resume: checkpoint aux_layers {state['aux_layers']} != the target's {aux_layers}")
    elif cfg.init_from is not None:
        warm = warm_head(cfg.init_from, model, aux_layers, cfg.draft_vocab, records=records, seed=cfg.seed)
        draft_ids = torch.arange(warm.draft_vocab_size) + warm.d2t.cpu()
    else:
        draft_ids, _, _ = build_draft_vocab(records, vocab, cfg.draft_vocab)
    torch.manual_seed(cfg.seed)
    head = warm if warm is not None else init_head(model, draft_ids, seed=cfg.seed)
    head.train()
    for p in head.embed.parameters():
        p.requires_grad_(False)  # the target's embedding is shared: never trained, never exported
    if cfg.freeze_lm_head:
        head.lm_head.weight.requires_grad_(False)
    params = _trainable(head)
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    step, history, train_seconds = 0, [], 0.0
    if state is not None:
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["optimizer"])
        step, history, train_seconds = state["step"], state["history"], state["train_seconds"]
        logger.info("resuming from step %d of %s", step, ckpt_path)
    t2d_index = torch.full((vocab,), -1, dtype=torch.long)
    t2d_index[draft_ids] = torch.arange(len(draft_ids))
    batches = _batches(records, cfg.batch_size)
    train_device = device
    head.to(train_device)

    saved = [step]  # the step of the newest checkpoint on disk (a resumed run starts at its checkpoint's)

    def checkpoint(reason: str) -> None:
        saved[0] = step
        _atomic_save({
            "step": step, "head": head.state_dict(), "optimizer": opt.state_dict(), "draft_ids": draft_ids,
            "aux_layers": list(aux_layers), "history": history, "train_seconds": train_seconds,
            "config": dataclasses.asdict(cfg),
        }, ckpt_path)  # fmt: skip
        export_head(head, out, cfg.export_dtype, lm_head_from=model if cfg.freeze_lm_head else None,
                    lm_head_int8=cfg.lm_head_int8)
        summary = _summary(cfg, argv, records, gen_tokens, step, history, t_data, train_seconds, draft_ids, aux_layers,
                           base)  # fmt: skip
        (out / "training.json").write_text(json.dumps(summary, indent=1))
        logger.info("checkpoint at step %d (%s) in %s", step, reason, out)

    prefetched: dict[int, torch.Tensor] = {}  # online features of the coming steps
    bar = tqdm(total=cfg.steps, initial=min(step, cfg.steps), desc="training", unit="step", disable=not progress)
    t_train = time.perf_counter()
    base_seconds = train_seconds
    try:
        while step < cfg.steps:
            if cfg.max_hours is not None and train_seconds > cfg.max_hours * 3600:
                logger.info("max_hours reached after %d steps; stopping", step)
                break
            for group in opt.param_groups:
                group["lr"] = _lr_at(step, cfg)
            idx = _batch_at(batches, step, cfg.seed)
            feats, tokens, tgt, tgt_p = _collate(records, idx, t2d_index, cfg.ttt_steps, train_device, online=online)
            if online:
                # Windows aligned to multiples of the prefetch: a resumed run pads each step's rows exactly
                # as an uninterrupted one does.
                if step not in prefetched:
                    first = step - step % ONLINE_PREFETCH_STEPS
                    window = range(first, min(first + ONLINE_PREFETCH_STEPS, cfg.steps))
                    made = _online_features(model, records, [_batch_at(batches, s, cfg.seed) for s in window],
                                            aux_layers, train_device)  # fmt: skip
                    prefetched = dict(zip(window, made))
                feats = prefetched.pop(step)
            outs = ttt_forward(head, feats, tokens, cfg.ttt_steps)
            loss, losses, accs = _step_loss(head, outs, tgt, tgt_p)
            opt.zero_grad(set_to_none=True)
            if loss is not None:  # a batch with no generated position has nothing to learn from
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
            # The history's loss, from the numbers already read (no second host read of the loss tensor).
            loss_value = sum(STEP_WEIGHT**j * ce for j, ce in enumerate(losses) if not math.isnan(ce))
            step += 1
            train_seconds = base_seconds + time.perf_counter() - t_train
            history.append({"step": step, "loss": loss_value, "ce": losses, "acc": accs, "lr": opt.param_groups[0]["lr"]})
            bar.update(1)
            bar.set_postfix(loss=f"{loss_value:.3f}", acc0=f"{accs[0]:.2f}", accN=f"{accs[-1]:.2f}")
            if step % cfg.checkpoint_every == 0 or step == cfg.steps:
                checkpoint("scheduled")
    except KeyboardInterrupt:
        logger.warning("interrupted at step %d; saving a checkpoint (resume with --resume)", step)
        checkpoint("interrupted")
        raise
    finally:
        bar.close()
    if saved[0] != step or not (out / "model.safetensors").is_file():  # e.g. stopped by max_hours mid-interval
        checkpoint("final")
    return json.loads((out / "training.json").read_text())


def _base_training(init_from: str | None) -> dict | None:
    """What a warm start began from: its directory and that head's own ``training.json`` (its command, data
    and losses, and its own ``init_from`` in turn), so a head trained on from another keeps its history in
    one file. Read once, before the first checkpoint."""
    if init_from is None:
        return None
    path = Path(init_from) / "training.json"
    return {"path": str(init_from), "training": json.loads(path.read_text()) if path.is_file() else None}


def _summary(cfg, argv, records, gen_tokens, step, history, t_data, train_seconds, draft_ids, aux_layers,
             init_from: dict | None) -> dict:  # fmt: skip
    tail = history[-20:]
    mean = lambda xs: float(sum(xs) / len(xs)) if xs else float("nan")  # noqa: E731
    per_step = len(tail[0]["ce"]) if tail else 0
    return {
        "command": "treecompile train-drafter " + " ".join(argv) if argv is not None else None,
        "sequences": len(records),
        "samples_per_prompt": cfg.samples_per_prompt,
        "temperature": cfg.temperature if cfg.samples_per_prompt > 1 else None,
        "generated_tokens": gen_tokens,
        "total_tokens": int(sum(len(r["tokens"]) for r in records)),
        "draft_vocab": int(len(draft_ids)),
        "aux_layers": list(aux_layers),
        "steps": step,
        "batch_size": cfg.batch_size,
        "ttt_steps": cfg.ttt_steps,
        "lr": cfg.lr,
        "weight_decay": cfg.weight_decay,
        "freeze_lm_head": cfg.freeze_lm_head,
        "lm_head_int8": cfg.lm_head_int8,
        "features": cfg.features,
        "data_generation_seconds": None if math.isnan(t_data) else round(t_data, 1),  # NaN: shards of older runs
        "train_seconds": round(train_seconds, 1),
        "final_loss_mean_last_20": mean([h["loss"] for h in tail]),
        "final_ce_per_ttt_step": [mean([h["ce"][j] for h in tail if not math.isnan(h["ce"][j])]) for j in range(per_step)],
        "final_top1_acc_per_ttt_step": [mean([h["acc"][j] for h in tail if not math.isnan(h["acc"][j])]) for j in range(per_step)],
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "init_from": init_from,  # a warm start's origin (_base_training)
    }
