"""Test-only launcher: TorchTitan's own trainer, unchanged, on CPU (tests/test_torchtitan.py).

Run under ``torchrun`` (one per replica group) exactly where a user runs
``torchtitan.train``: it parses the same arguments (``--module torchft.llama3 --config
llama3_torchft_debugmodel --fault_tolerance.* ...``), builds the trainer from the config and
trains it. What it adds, none of it in TorchTitan's files:

* torch is told there is no accelerator (``torch._utils._get_available_device_type`` answers
  "cpu" before torchtitan is imported), so TorchTitan picks device "cpu", torch's default
  backend for it (gloo) and ``torch.cpu`` as its device module; the few ``torch.cuda`` calls
  it still makes on its setup path are answered for a machine without a GPU.
* one JSON line per training step on stdout (``TITAN {...}``: the trainer's step, the
  fault-tolerance manager's step count, what its ``should_commit`` answered during the step,
  and the wall time) so the test can see when a restarted group healed and committed,
  without reading either library's log wording (``should_commit`` is wrapped on the manager
  instance to record its answer, which it returns unchanged);
* at the end, ``TITAN {"params": {...}}``: a sha256 per parameter (the full tensor) so the
  test can check that the replica groups ended with identical weights.

``python launch.py assets DIR`` writes the tokenizer (``DIR/tests/assets/tokenizer``) and the
dataset (``DIR/tests/assets/c4_test``, TorchTitan's ``c4_test`` name) at the relative paths
the debug config reads: nothing is fetched.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch._utils

# Before torchtitan is imported: its device helpers read this at import time.
torch._utils._get_available_device_type = lambda: "cpu"  # type: ignore[assignment]


class _CpuProperties:
    name = "cpu"
    total_memory = 64 * 1024**3


def _patch_cpu_device_module() -> None:
    """``torch.cpu`` as TorchTitan's device module: the memory monitor's calls (a CUDA
    caching allocator's statistics) answered with "nothing measured"."""
    cpu = torch.cpu
    for name, fn in {
        "get_device_name": lambda device=None: "cpu",
        "get_device_properties": lambda device=None: _CpuProperties(),
        "memory_stats": lambda device=None: {},
        "reset_peak_memory_stats": lambda device=None: None,
        "empty_cache": lambda: None,
    }.items():
        if not hasattr(cpu, name):
            setattr(cpu, name, fn)
    # torch.cpu.current_device() is the string "cpu"; TorchTitan passes it as a barrier's
    # device id (an int, as torch.cuda's is).
    cpu.current_device = lambda: 0  # type: ignore[assignment,return-value]


_patch_cpu_device_module()


def _cpu_varlen_attn(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_q: torch.Tensor,
                     cu_seq_k: torch.Tensor | None, max_q: int, max_k: int, *, return_aux: Any = None,
                     scale: float | None = None, window_size: tuple[int, int] = (-1, -1), enable_gqa: bool = False,
                     **_: Any) -> torch.Tensor:
    """``torch.nn.attention.varlen.varlen_attn`` (Flash Attention, CUDA only) computed on CPU:
    each packed sequence's causal (or full) attention with ``scaled_dot_product_attention``'s
    math kernel, in float32, cast back. No sliding window, no LSE (the llama3 model asks for
    neither)."""
    import torch.nn.functional as F

    if return_aux is not None and getattr(return_aux, "lse", False):
        raise NotImplementedError("the CPU varlen_attn of tests/titan/launch.py returns no LSE")
    if window_size[0] != -1:
        raise NotImplementedError("the CPU varlen_attn of tests/titan/launch.py has no sliding window")
    cu_k = cu_seq_q if cu_seq_k is None else cu_seq_k
    bounds_q, bounds_k = cu_seq_q.tolist(), cu_k.tolist()
    outs = []
    for i in range(len(bounds_q) - 1):
        q = query[bounds_q[i]:bounds_q[i + 1]].transpose(0, 1).float()
        k = key[bounds_k[i]:bounds_k[i + 1]].transpose(0, 1).float()
        v = value[bounds_k[i]:bounds_k[i + 1]].transpose(0, 1).float()
        o = F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=window_size[1] == 0,
                                           enable_gqa=enable_gqa)
        outs.append(o.transpose(0, 1).to(query.dtype))
    return torch.cat(outs, dim=0)


import torch.nn.attention.varlen as _varlen  # noqa: E402

_varlen.varlen_attn = _cpu_varlen_attn  # type: ignore[assignment]

MARK = "TITAN "
WORDS = ("the", "a", "replica", "group", "heals", "from", "its", "peer", "and", "trains", "on", "with",
         "lighthouse", "quorum", "step", "commits", "model", "weights", "state", "fault", "tolerant",
         "training", "runs", "again", "after", "kill", "restart", "loss", "goes", "down", "slowly")


def emit(obj: dict[str, Any]) -> None:
    """One machine-readable line for the test."""
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def make_assets(root: Path) -> None:
    """A word-level tokenizer (with BOS/EOS) and a small JSON-lines text dataset, both made
    here, at the paths TorchTitan's debug config and ``c4_test`` dataset read (relative to the
    working directory the trainer runs in)."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel

    tok_dir = root / "tests" / "assets" / "tokenizer"
    data_dir = root / "tests" / "assets" / "c4_test"
    tok_dir.mkdir(parents=True, exist_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    specials = ["[UNK]", "<|begin_of_text|>", "<|end_of_text|>"]
    vocab = {w: i for i, w in enumerate([*specials, *WORDS, *(str(n) for n in range(500))])}
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()  # type: ignore[assignment]
    tok.add_special_tokens(specials[1:])
    tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "add_bos_token": True,
        "add_eos_token": False, "tokenizer_class": "PreTrainedTokenizerFast"}))
    rng = random.Random(0)
    with open(data_dir / "train.json", "w") as f:
        for i in range(4000):
            text = " ".join(rng.choice(WORDS) if rng.random() < 0.7 else str(rng.randrange(500))
                            for _ in range(rng.randrange(40, 200)))
            f.write(json.dumps({"text": text, "timestamp": str(i), "url": f"local://{i}"}) + "\n")


def _param_hashes(model_parts: list[torch.nn.Module]) -> dict[str, str]:
    out: dict[str, str] = {}
    for i, part in enumerate(model_parts):
        for name, p in part.named_parameters():
            t = p.detach()
            full = getattr(t, "full_tensor", None)
            if full is not None:
                t = full()
            data = t.contiguous().cpu().float().numpy().tobytes()
            out[f"{i}.{name}"] = hashlib.sha256(data).hexdigest()[:16]
    return out


def train(argv: list[str]) -> None:
    """TorchTitan's ``torchtitan.train.main``, with the step lines and the final hashes."""
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger

    init_logger()
    config = ConfigManager().parse_args(argv)
    trainer = config.build()  # type: ignore[attr-defined]
    inner = trainer.train_step
    ft = trainer.ft_manager
    votes: list[bool] = []
    #: the lr each update of this step used: read right after should_commit, where a heal's
    #: state (optimizer and lr scheduler included) has been applied and the update follows
    used_lr: list[float] = []
    if ft.enabled:
        manager = ft.manager
        should_commit = manager.should_commit

        def observed_should_commit(*args: Any, **kwargs: Any) -> bool:
            ok = should_commit(*args, **kwargs)
            votes.append(bool(ok))
            used_lr.append(float(trainer.optimizers.optimizers[0].param_groups[0]["lr"]))
            return ok

        manager.should_commit = observed_should_commit  # this instance only, observed not changed

    def train_step(*args: Any, **kwargs: Any) -> Any:
        votes.clear()
        used_lr.clear()
        out = inner(*args, **kwargs)
        committed = ft.manager.current_step() if ft.enabled else trainer.step
        # ok: this step's should_commit answers (none on DiLoCo's inner steps); lr: the lr
        # its update used (None where there was no vote)
        emit({"step": trainer.step, "committed": committed, "ok": list(votes),
              "lr": used_lr[-1] if used_lr else None, "t": time.time()})
        return out

    trainer.train_step = train_step  # this instance only: TorchTitan's class is untouched
    try:
        trainer.train()
        emit({"done": True, "step": trainer.step, "params": _param_hashes(trainer.model_parts), "t": time.time()})
    finally:
        trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    # A daemon thread (the manager's quorum/serving threads) may still be inside torch's C++
    # code: leave at once, with success, instead of tearing the interpreter down around it.
    os._exit(0)


def main() -> None:
    if len(sys.argv) >= 3 and sys.argv[1] == "assets":
        make_assets(Path(sys.argv[2]))
        return
    train(sys.argv[1:])


if __name__ == "__main__":
    main()
