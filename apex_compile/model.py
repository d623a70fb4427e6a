"""`optimize(hf_model)` -> `ApexModel`: HF-compatible `generate()` and forward on the paged-KV engine."""
import warnings
from typing import List, Optional, Sequence, Union

import torch

from apex_compile.config import ApexConfig
from apex_compile.runtime.engine import Engine
from apex_compile.runtime.kv_manager import POOL_NAMES
from apex_compile.runtime.request import SamplingParams

_HF_DEFAULT_MAX_LENGTH = 20  # GenerationConfig's max_length when nothing sets it
_RIGHT_PADDING_WARNING = ("A decoder-only architecture is being used, but right-padding was detected! For correct "
                          "generation results, please set `padding_side='left'` when initializing the tokenizer.")

# generate() keyword arguments accepted when they ask for HF's default behaviour (anything else raises).
_DEFAULT_ONLY = {"num_beams": 1, "num_return_sequences": 1, "output_scores": False, "output_logits": False,
                 "output_attentions": False, "output_hidden_states": False, "min_length": 0}


def optimize(hf_model: torch.nn.Module, config: Optional[ApexConfig] = None, tokenizer=None) -> "ApexModel":
    """Wraps a HF LLaMA-family causal LM in an `ApexModel` (paged KV pools, compiled step, scheduler).

    The HF model itself is left unchanged. `tokenizer` (optional) enables string prompts and stop strings in
    `ApexModel.engine`. A tokenizer passed second (`optimize(hf_model, tokenizer)`) is taken as the tokenizer.
    """
    if config is not None and not isinstance(config, ApexConfig):
        if tokenizer is None and hasattr(config, "encode") and hasattr(config, "decode"):
            config, tokenizer = None, config  # optimize(hf_model, tokenizer)
        else:
            raise TypeError(f"apex_compile.optimize(hf_model, config=None, tokenizer=None): config must be an "
                            f"ApexConfig, got {type(config).__name__}")
    return ApexModel(hf_model, config, tokenizer)


def _as_strings(value) -> tuple:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def _as_list(value) -> List[int]:
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return [int(v) for v in value.flatten().tolist()]
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _cpu_summary(report) -> str:
    """One line for a CPU graph's pass report: its attention sites and packed linears (no fusion table)."""
    sites = getattr(report, "attention_sites", [])
    forms = sorted({site.form for site in sites})
    text = (f"{len(sites)} attention layer(s) ({', '.join(forms) or '-'}), "
            f"{getattr(report, 'packed_linears', 0)} linear layers on oneDNN packed weights")
    misses = getattr(report, "misses", [])
    if misses:
        text += f"; {len(misses)} candidate(s) not rewritten"
    return text


class ApexModel:
    """A HF causal LM served by the apex engine: `generate()` and `model(input_ids)` behave like HF's."""

    def __init__(self, hf_model: torch.nn.Module, config: Optional[ApexConfig] = None, tokenizer=None):
        if config is not None and not isinstance(config, ApexConfig):
            raise TypeError(f"ApexModel(hf_model, config=None, tokenizer=None): config must be an ApexConfig, got "
                            f"{type(config).__name__} (pass a tokenizer as tokenizer=...)")
        self.hf_model = hf_model
        self.apex_config = config or ApexConfig()
        self.engine = Engine(hf_model, self.apex_config, tokenizer)

    def close(self) -> None:
        """Frees the engine's KV pools, threads and graphs (`Engine.close`); the HF model stays as it is."""
        self.engine.close()

    def __enter__(self) -> "ApexModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def config(self):
        """The HF model's config (`apex_config` holds the engine's settings)."""
        return self.hf_model.config

    @property
    def generation_config(self):
        """The HF model's generation config: the defaults of `generate`."""
        return self.hf_model.generation_config

    @property
    def device(self) -> torch.device:
        """The model's device."""
        return self.engine.device

    @property
    def dtype(self) -> torch.dtype:
        """The model's dtype."""
        return self.engine.dtype

    def eval(self) -> "ApexModel":
        """Inference is all the engine does: a no-op that returns self, as `nn.Module.eval` does."""
        self.hf_model.eval()
        return self

    def __call__(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, **kwargs):
        """Logits of every position, as the HF model's forward returns them (`.logits` [B, L, vocab]).

        With an attention_mask, each row is computed without its padding (positions from 0, as `generate` does)
        and padded positions get zero logits.
        """
        from transformers.modeling_outputs import CausalLMOutputWithPast

        unknown = sorted(k for k, v in kwargs.items() if v is not None and k not in ("use_cache", "return_dict"))
        if unknown:
            raise ValueError(f"ApexModel forward does not support {unknown}")
        rows, mask = self._rows(input_ids, attention_mask)
        scores = self.engine.score(rows)
        batch, length = input_ids.shape
        logits = torch.zeros(batch, length, scores[0].shape[-1], dtype=scores[0].dtype, device=scores[0].device)
        for i, row_logits in enumerate(scores):
            logits[i, length - row_logits.shape[0]:] = row_logits
        return CausalLMOutputWithPast(logits=logits.to(input_ids.device))

    forward = __call__

    def _rows(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor]):
        """Unpadded token lists of a left-padded batch (errors for right padding or empty rows)."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError("input_ids must be a 2-D LongTensor [batch, length]")
        if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
            raise ValueError(f"input_ids must hold integer token ids (a LongTensor), got {input_ids.dtype}")
        if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
            raise ValueError(f"empty input: input_ids has shape {tuple(input_ids.shape)}")
        if attention_mask is None:
            mask = torch.ones_like(input_ids, dtype=torch.bool)
        else:
            if attention_mask.shape != input_ids.shape:
                raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape "
                                 f"{tuple(input_ids.shape)}")
            values = attention_mask.detach()
            if values.numel() and not bool(((values == 0) | (values == 1)).all()):
                raise ValueError("attention_mask must hold 0/1 values (1: a token, 0: padding), got values such as "
                                 f"{values[(values != 0) & (values != 1)].flatten()[:3].tolist()}")
            mask = attention_mask.to(torch.bool)
        ids, mask = input_ids.cpu(), mask.cpu()
        rows = []
        for i in range(ids.shape[0]):
            keep = mask[i]
            count = int(keep.sum())
            if count == 0:
                raise ValueError(f"row {i} of the batch is empty (its attention_mask is all zeros)")
            if not bool(keep[ids.shape[1] - count:].all()):
                raise ValueError(f"row {i} is not left-padded: apex_compile needs left padding "
                                 "(tokenizer.padding_side = 'left'), as HF generate does for decoder-only models")
            rows.append(ids[i, ids.shape[1] - count:].tolist())
        return rows, mask

    def generate(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                 max_new_tokens: Optional[int] = None, do_sample: Optional[bool] = None,
                 temperature: Optional[float] = None, top_k: Optional[int] = None, top_p: Optional[float] = None,
                 eos_token_id: Union[None, int, Sequence[int]] = None, pad_token_id: Optional[int] = None,
                 max_length: Optional[int] = None, generation_config=None, streamer=None,
                 stop_strings: Union[None, str, Sequence[str]] = None, tokenizer=None,
                 repetition_penalty: Optional[float] = None, min_new_tokens: Optional[int] = None,
                 return_dict_in_generate: Optional[bool] = None, **kwargs):
        """Same call and result as HF `generate` for greedy / sampled decoding.

        Returns [batch, prompt_len + new_len] (LongTensor): the (left-padded) prompt, then each row's tokens;
        a row that emitted EOS is padded with pad_token_id up to the longest row, as HF does; with
        `return_dict_in_generate=True`, HF's output object with `.sequences`. Unset arguments come from
        `generation_config` (default: the model's). Sampling draws from torch's global RNG (`torch.manual_seed`
        makes it reproducible). Also as HF: `streamer` (TextStreamer / TextIteratorStreamer: `put` gets the
        prompt, then each new token; batch size 1, as HF's streamers require), `stop_strings` with `tokenizer`,
        `repetition_penalty`, `min_new_tokens`. Anything else that changes the result raises ValueError.
        """
        gen = generation_config or self.hf_model.generation_config
        for name, value in kwargs.items():
            if name == "use_cache" or value is None:
                continue
            if name not in _DEFAULT_ONLY or value != _DEFAULT_ONLY[name]:
                raise ValueError(f"ApexModel.generate does not support {name}={value!r}")
        eos = _as_list(eos_token_id if eos_token_id is not None else gen.eos_token_id)
        pad = pad_token_id if pad_token_id is not None else gen.pad_token_id
        if pad is None:
            pad = eos[0] if eos else 0
        if (attention_mask is None and isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2
                and input_ids.shape[0] > 1 and input_ids.shape[1] and bool((input_ids[:, -1] == pad).any())):
            warnings.warn(_RIGHT_PADDING_WARNING, UserWarning, stacklevel=2)  # HF's check without a mask
        if attention_mask is None and isinstance(input_ids, torch.Tensor):
            attention_mask = self._infer_mask(input_ids, pad, eos)
        rows, _ = self._rows(input_ids, attention_mask)
        length = input_ids.shape[1]
        max_new_tokens = self._new_tokens(gen, generation_config, length, max_new_tokens, max_length)
        do_sample = bool(gen.do_sample) if do_sample is None else bool(do_sample)
        filters = {}
        if do_sample:  # greedy decoding ignores them, as HF's does
            filters = dict(temperature=(temperature if temperature is not None else (gen.temperature or 1.0)),
                           top_k=(top_k if top_k is not None else (gen.top_k or 0)),
                           top_p=(top_p if top_p is not None else (gen.top_p or 1.0)))
        stops = _as_strings(stop_strings if stop_strings is not None else getattr(gen, "stop_strings", None))
        if stops and tokenizer is None and self.engine.tokenizer is None:
            raise ValueError("stop_strings need a tokenizer: pass tokenizer= to generate (as HF's generate needs) "
                             "or to apex_compile.optimize")
        penalty = repetition_penalty if repetition_penalty is not None else (gen.repetition_penalty or 1.0)
        sampling = SamplingParams(
            max_new_tokens=max_new_tokens, do_sample=do_sample, eos_token_ids=tuple(eos), stop_strings=stops,
            repetition_penalty=penalty,
            min_new_tokens=min_new_tokens if min_new_tokens is not None else (gen.min_new_tokens or 0), **filters)
        outputs = self._run(rows, sampling, streamer, input_ids, tokenizer)
        new_len = max(len(tokens) for tokens in outputs)
        out = torch.full((len(rows), length + new_len), pad, dtype=torch.long)
        out[:, :length] = input_ids.cpu()
        for i, tokens in enumerate(outputs):
            out[i, length:length + len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        out = out.to(input_ids.device)
        return_dict = return_dict_in_generate if return_dict_in_generate is not None else \
            getattr(gen, "return_dict_in_generate", False)
        if return_dict:
            from transformers.generation.utils import GenerateDecoderOnlyOutput

            return GenerateDecoderOnlyOutput(sequences=out)
        return out

    def _new_tokens(self, gen, generation_config, length: int, max_new_tokens: Optional[int],
                    max_length: Optional[int]) -> int:
        """New tokens to generate, by HF's precedence: max_new_tokens (argument, then generation config) over
        max_length (argument, then the given generation config, then the model's); with neither, HF's default of
        20 new tokens (`GenerationConfig.max_length`'s 20, counted past the prompt, capped by the model's
        max_position_embeddings), with HF's warning."""
        explicit_length = max_length
        if explicit_length is None and generation_config is not None:
            explicit_length = generation_config.max_length
        if explicit_length is None:
            explicit_length = self.hf_model.generation_config.max_length
        if max_new_tokens is None:
            max_new_tokens = gen.max_new_tokens
        if max_new_tokens is not None:
            total = max_new_tokens + length
        elif explicit_length is not None:
            total = explicit_length
        else:
            warnings.warn(f"Using the model-agnostic default `max_length` (={_HF_DEFAULT_MAX_LENGTH}) to control the "
                          "generation length. We recommend setting `max_new_tokens` to control the maximum length "
                          "of the generation.", UserWarning, stacklevel=3)
            total = _HF_DEFAULT_MAX_LENGTH + length
            positions = getattr(self.hf_model.config, "max_position_embeddings", None)
            if positions is not None:
                total = min(total, positions)
        if length >= total:
            raise ValueError(f"Input length of input_ids is {length}, but `max_length` is set to {total}. This can "
                             "lead to unexpected behavior. You should consider increasing `max_length` or, better "
                             "yet, setting `max_new_tokens`.")
        return total - length

    def _run(self, rows: List[List[int]], sampling: SamplingParams, streamer, input_ids: torch.Tensor,
             tokenizer) -> List[List[int]]:
        """New tokens of every row; feeds `streamer` as HF does (prompt first, then each token, then end())."""
        engine = self.engine
        previous = engine.tokenizer
        if tokenizer is not None:
            engine.tokenizer = tokenizer
        try:
            if streamer is None:
                return [c.token_ids for c in engine.generate(rows, sampling)]
            streamer.put(input_ids.cpu())  # HF's streamers raise here for a batch of more than one row
            outputs: List[List[int]] = [[] for _ in rows]
            for event in engine.stream(rows, sampling):
                outputs[event.index].append(event.token_id)
                streamer.put(torch.tensor([event.token_id]))
            streamer.end()
            return outputs
        finally:
            engine.tokenizer = previous

    @staticmethod
    def _infer_mask(input_ids: torch.Tensor, pad: int, eos: List[int]) -> Optional[torch.Tensor]:
        """HF's rule: mask out pad tokens when the pad token occurs and differs from every EOS token."""
        if pad in eos or not bool((input_ids == pad).any()):
            return None
        return input_ids.ne(pad).long()

    def explain(self, file=None) -> str:
        """Prints (and returns) the pass report of each compiled graph, the pools and the offload decision."""
        engine = self.engine
        lines = [f"apex_compile: {type(self.hf_model).__name__} ({self.hf_model.config.model_type}) on "
                 f"{engine.device}, {engine.dtype}"]
        kv = engine.kv
        for pool in kv.pools:
            tokens = pool.num_blocks * kv.block_size
            mib = pool.num_blocks * kv.shape.block_bytes / (1 << 20)
            lines.append(f"  {pool.name} pool: {pool.num_blocks} blocks of {kv.block_size} tokens "
                         f"({tokens} tokens, {mib:.1f} MiB) on {pool.device}")
        lines.append("  offload: " + self.offload_decision())
        config = self.apex_config
        lines.append(f"  batching: max_num_seqs={config.max_num_seqs}, max_num_batched_tokens="
                     f"{config.max_num_batched_tokens} (chunked prefill), prefill_tokens_while_decoding="
                     f"{config.prefill_tokens_while_decoding}, preemption={config.preemption}")
        if not self.apex_config.compile:
            lines.append("  compile: off (eager HF modules, attention routed to the paged runner"
                         + ("; fp32 linears on oneDNN-packed weights)" if engine.device.type == "cpu" else ")"))
        elif not engine.reports:
            lines.append("  compile: apex backend (no graph compiled yet: run generate() first)")
        on_cpu = engine.device.type == "cpu" and self.apex_config.compile
        if on_cpu and engine.reports:
            lines.append("  CPU path: the RMSNorm / SwiGLU / q-k-v fusions are left unfused on purpose (the fused "
                         "ops' CPU implementations are the same aten ops behind a custom-op call that costs more "
                         "than it saves); attention runs on the CPU over the paged KV pools, both of them host RAM")
        shown = []
        for i, report in enumerate(engine.reports):
            text = _cpu_summary(report) if on_cpu else str(report)
            if text in shown:
                lines.append(f"  compiled graph {i} (another shape): the same rewrites as graph {shown.index(text)}")
                continue
            shown.append(text)
            if on_cpu:
                lines.append(f"  compiled graph {i}: {text}")
                continue
            lines.append(f"  compiled graph {i}:")
            lines.extend("    " + line for line in text.splitlines())
        stats = engine.stats
        if stats.steps:
            per_pool = ", ".join(f"{n} {c}" for n, c in zip(POOL_NAMES, stats.requests_per_pool))
            lines.append(f"  run so far: {stats.steps} steps, {stats.generated_tokens} tokens generated, requests "
                         f"per pool: {per_pool}; moved {stats.moved}, parked {stats.parked}, recomputed "
                         f"{stats.recomputed}")
        text = "\n".join(lines)
        print(text, file=file)
        return text

    def offload_decision(self) -> str:
        """One line saying where requests run and why."""
        mode = self.apex_config.offload
        engine = self.engine
        if mode == "auto" and engine.auto_policy is None:
            return ("auto -> never: on a CPU-only run both pools are host memory (nothing to offload); on CUDA "
                    "the performance model needs a host pool (cpu_cache_size > 0) and the compiled step")
        if mode == "auto":
            tokens = [p.num_blocks * engine.kv.block_size for p in engine.kv.pools]
            context = min(1024, engine.max_model_len)
            if engine.stagger is not None:
                rows = engine.stagger.rows
                verdict = (f"staggered: requests the device pool cannot take decode from the host pool, up to "
                           f"{engine.stagger.width} row(s) per step (now {rows.share():.3g}: the model's "
                           f"{rows.ceiling}, the measured CPU job's {rows.fraction:.3g})")
            elif engine.scheduler.host_policy is not None:
                verdict = "host requests admitted when the device pool is full and the model predicts a gain"
            else:
                verdict = "never: the model predicts no gain for typical loads"
            lines = engine.auto_policy.explain(tokens[0], tokens[1], self.apex_config.max_num_seqs, context)
            return f"auto -> {verdict}; measured model at {context}-token requests:\n    " + "\n    ".join(lines)
        if mode == "never":
            return "never: every running request in the device pool; the host pool only parks swapped-out requests"
        if mode == "staggered":
            width = engine.stagger.width if engine.stagger is not None else 0
            capacity = engine.stagger.capacity if engine.stagger is not None else 0
            lanes = engine.stagger.num_lanes if engine.stagger is not None else 0
            return (f"staggered: requests the device pool cannot take decode from the host pool, {width} row(s) per "
                    f"step, their tokens one layer further on per turn of {lanes} lane(s) ({capacity} in flight)")
        if mode == "all":
            return "all: every running request keeps its KV in the host pool and attends on the CPU"
        return (f"fraction {float(mode):g}: about that share of running requests in the host pool (CPU attention), "
                "the rest in the device pool")
