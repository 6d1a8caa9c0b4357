"""Text generation: each member's own continuation, or ensemble decoding (one shared continuation).

    pipe = pipeline("text-generation", model=wide)                  # combine="mean": ensemble decoding
    pipe("once upon a time", max_new_tokens=20)
    # {"generated_text": ..., "uncertainty": {...}}   (+ "members" with return_members=True)
    pipeline("text-generation", model=wide, combine="none")("once")
    # {"members": [{"member": 0, "generated_text": ...}, ...]}

Ensemble decoding: at every step all N members read the same prefix in one wide forward (a KV cache of
N*B rows, one new token per row), their next-token distributions are combined (``combine=``: the mean by
default, as for classification) and one token is chosen for all of them: the argmax (``do_sample=False``)
or a draw after ``top_k`` / ``top_p`` filtering (``do_sample=True``, ``seed=`` or ``generator=``), each
member's scores first shaped by the logits processors its generation config asks for (a repetition
penalty, ...), as its own generate would. Rows stop at an eos token. Per-member continuations come from
:meth:`WideModel.generate` (transformers' own loop).
"""

from __future__ import annotations

import inspect
import numbers
import threading
from typing import Any

import torch

from .. import metrics
from ..generation_configs import GenerationConfigsDiffer
from ..verify_cache import cache_name as cache_name_of
from .base import WidePipeline, _max_length
from .combine import Combine, combine, member_probabilities, ranking
from .generation_settings import GenerationSettings
from .options import positive_temperature, sampling_seed, whole_number

# Held while members' own continuations draw from torch's global generator (transformers' sampling takes no other)
GLOBAL_RNG = threading.Lock()
MEASURES = ("predictive_entropy", "expected_entropy", "mutual_information", "member_std", "agreement")


class TextGenerationPipeline(GenerationSettings, WidePipeline):
    """``pipe(prompt)`` -> ``{"generated_text", "uncertainty"}`` (the ensemble's continuation, with each
    measure averaged over the generated tokens), or ``{"members": [...]}`` with ``combine="none"``.

    Options: ``max_new_tokens`` (the members' own, or what their ``max_length`` leaves after each prompt, else 20),
    ``do_sample``, ``temperature``, ``top_k``,
    ``top_p``, ``seed`` / ``generator`` (sampling), ``return_full_text`` (True: prompt + continuation, as
    transformers), ``return_members`` (also each member's own continuation), ``truncation`` (True: prompts too
    long for the model's positions keep their last tokens; False: refuse them), ``eos_token_id`` (the tokens
    that end every member's continuation, as ``generate(eos_token_id=)``; needed where the members' generation
    configs end at different ones). Prompts are left-padded."""

    task = "text-generation"
    heads = ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "a language-modeling head (...ForCausalLM)")

    def _sanitize_parameters(self, max_new_tokens: int | None = None, do_sample: bool | None = None,
                             temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                             seed: int | None = None, generator: torch.Generator | None = None,
                             return_full_text: bool | None = None, return_members: bool | None = None,
                             truncation: bool | None = None, eos_token_id: int | list[int] | None = None, **kwargs):
        pre, fwd, post = super()._sanitize_parameters(**kwargs)
        if self.combine == Combine.VOTE and do_sample:
            raise ValueError("combine='vote' has no distribution to sample from; use do_sample=False or another rule.")
        if max_new_tokens is not None:
            max_new_tokens = whole_number("max_new_tokens", max_new_tokens)
            pre["max_new_tokens"] = max_new_tokens  # each prompt's budget, in its features
        temperature = None if temperature is None else positive_temperature(temperature)
        seed = None if seed is None else sampling_seed(seed)  # (2**64 raised "Overflow when unpacking long long")
        top_k = None if top_k is None else whole_number("top_k", top_k)
        if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not 0 < top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {top_p}.")
        options = dict(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                       generator=generator, return_members=return_members, eos_token_id=eos_token_id)
        fwd.update({k: v for k, v in options.items() if v is not None})
        if truncation is not None:
            pre["truncation"] = truncation
        if return_full_text is not None:
            post["return_full_text"] = return_full_text
        return pre, fwd, post

    # ---------------------------------------------------------------- the four steps
    def preprocess(self, prompt, truncation: bool = True, max_new_tokens: int | None = None):
        if self.tokenizer is None:
            raise ValueError("This pipeline needs a tokenizer: pass tokenizer=, or load members that ship one.")
        if not isinstance(prompt, str):
            raise TypeError(f"Expected a prompt (str), got {type(prompt).__name__}.")
        if not prompt.strip():
            raise ValueError("Got an empty prompt: give the members some text to continue.")
        encoded = self.tokenizer(prompt, return_tensors="pt")
        ids, mask = encoded["input_ids"], encoded["attention_mask"]
        if ids.shape[-1] == 0:  # a text the tokenizer drops whole: BOS, where transformers' generate starts without
            ids = torch.tensor([[self._bos_id(prompt)]])  # input_ids (beside other prompts, a row of padding was
            mask = torch.ones_like(ids)  # continued)
        max_new_tokens = max_new_tokens or self._default_new_tokens(ids.shape[-1])
        budget = _max_length(self.tokenizer, self.model) - max_new_tokens  # positions left for the prompt
        if budget < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt within the model's "
                             f"{budget + max_new_tokens} positions.")
        if ids.shape[-1] > budget:
            if not truncation:
                raise ValueError(f"The prompt is {ids.shape[-1]} tokens long; with max_new_tokens={max_new_tokens} "
                                 f"the model has room for {budget}. Pass truncation=True to keep its last tokens.")
            ids, mask = ids[:, -budget:], mask[:, -budget:]  # the end of a prompt is what it continues
        return {"input_ids": ids, "attention_mask": mask, "text": prompt, "new_tokens": torch.tensor([max_new_tokens])}

    def collate(self, features):
        """Left padding to the longest prompt: the last column is every row's newest token."""
        length = max(f["input_ids"].shape[-1] for f in features)
        pad = self._pad_id()
        ids = [torch.nn.functional.pad(f["input_ids"], (length - f["input_ids"].shape[-1], 0), value=pad)
               for f in features]
        mask = [torch.nn.functional.pad(f["attention_mask"], (length - f["attention_mask"].shape[-1], 0))
                for f in features]
        return {"input_ids": torch.cat(ids), "attention_mask": torch.cat(mask),
                "new_tokens": torch.cat([f["new_tokens"] for f in features])}  # (B,): each prompt's own

    def _forward(self, batch, do_sample: bool = False,
                 temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                 seed: int | None = None, generator: torch.Generator | None = None, return_members: bool = False,
                 eos_token_id: int | list[int] | None = None):
        sampling = dict(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                        eos_token_id=eos_token_id)
        batch = dict(batch)
        budgets = batch.pop("new_tokens")  # (B,) each prompt's new tokens (the call's max_new_tokens, else its own)
        max_new_tokens = int(budgets.max())
        out = {}
        if self.combine == Combine.NONE or return_members:
            tokens = self._member_continuations(batch, max_new_tokens, seed, generator, **sampling)  # (N, B, S)
            past = torch.arange(tokens.shape[-1], device=tokens.device) >= budgets[:, None].to(tokens.device)  # (B, S)
            ends = torch.tensor(self._generate_eos(eos_token_id), dtype=tokens.dtype, device=tokens.device)
            ended = torch.isin(tokens, ends)  # (N, B, S)
            out["per_member_tokens"] = tokens
            # each row ends at its own budget, and at its first end token (a padding that is no special token of the
            # tokenizer read as text: a member done before another went on with it)
            out["per_member_valid"] = ~past & (ended.long().cumsum(-1) - ended.long() == 0)
        if self.combine != Combine.NONE:
            if do_sample and generator is None:
                generator = torch.Generator(self.device)
                if seed is None and self.model.members_group is not None:  # every rank must draw the same tokens
                    from ..parallel import shared_seed

                    seed = shared_seed(self.model.members_group)
                if seed is not None:
                    generator.manual_seed(seed)
                else:
                    generator.seed()
            out.update(self._ensemble_decode(batch, budgets, generator=generator, **sampling))
        return out

    def postprocess(self, outputs: dict[str, Any], return_full_text: bool = True):
        prompt = outputs["features"]["text"] if return_full_text else ""

        def text(tokens: torch.Tensor) -> str:
            return prompt + self.tokenizer.decode(tokens.tolist(), skip_special_tokens=True)

        result: dict[str, Any] = {}
        if "tokens" in outputs:
            valid = outputs["valid"].bool()  # (S,): tokens up to and including eos
            result["generated_text"] = text(outputs["tokens"])
            result["uncertainty"] = {k: float(outputs[k][valid].mean()) for k in MEASURES}
        if "per_member_tokens" in outputs:
            result["members"] = [{"member": i, "generated_text": text(t[valid])} for i, (t, valid) in
                                 enumerate(zip(outputs["per_member_tokens"], outputs["per_member_valid"]))]
        return result

    def batch_invariant(self, fwd: dict) -> bool:
        """Greedy decoding is; sampling is not (the draws of a batch come from one generator, in batch order)."""
        return not fwd.get("do_sample", False)

    # ---------------------------------------------------------------- decoding
    def _ensemble_decode(self, batch, budgets: torch.Tensor, do_sample: bool, temperature: float | None,
                         top_k: int | None, top_p: float | None, eos_token_id: int | list[int] | None,
                         generator: torch.Generator | None):
        """One shared continuation per row, of at most ``budgets[b]`` tokens; each step is one wide forward of N*B
        rows, one new token each."""
        ids, mask = batch["input_ids"], batch["attention_mask"]  # (B, T), left-padded
        max_new_tokens, budgets = int(budgets.max()), budgets.to(ids.device)
        # A sampling temperature tempers each member's distribution before they are combined; greedy decoding takes
        # none, as transformers' generate ignores one without do_sample (the calibrated temperature applies to both)
        temperature = (temperature if do_sample else None) or self.temperature
        # Positions as transformers' generate makes them: padding does not count.
        positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)  # (B, T)
        eos = torch.tensor(self._eos_ids(eos_token_id), device=ids.device, dtype=ids.dtype)
        done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
        keep = {"logits_to_keep": 1} if self._keeps_logits() else {}
        cache_name = cache_name_of(self.model.model) or "past_key_values"  # Mamba: cache_params
        processors = self._member_processors(ids, mask, max_new_tokens, eos_token_id)
        cache, step_ids, steps, generated = None, ids, [], ids  # generated: (B, T + s), what the processors read
        masks_steps = True  # whether the members' generate passes the mask with each new token (below)
        for step in range(max_new_tokens):
            if step == 1:
                masks_steps = self._masks_steps(step_ids, mask, cache_name, cache)
            out = self.model(input_ids=step_ids, attention_mask=mask if masks_steps else None,
                             position_ids=positions, use_cache=True, **{cache_name: cache}, **keep)
            cache, logits = getattr(out, cache_name), out.logits[:, :, -1]  # (N, B, V)
            if processors is not None:  # each member's scores as its own generate would draw from them
                logits = torch.stack([process(generated, logits[i].float()) for i, process in enumerate(processors)])
            member_probs = member_probabilities(logits, False, temperature)  # (N, B, V)
            probs = combine(logits, self.combine, self.weights, False, temperature)  # (B, V)
            if do_sample:
                token = torch.multinomial(_filter(probs, top_k, top_p), 1, generator=generator).squeeze(-1)
            else:
                token = ranking(probs, member_probs).argmax(-1)  # (B,)
            token = token.masked_fill(done, self._pad_id())
            steps.append({"tokens": token, "valid": ~done, **metrics.uncertainty(member_probs, token, self.weights)})
            done = done | torch.isin(token, eos) | (budgets <= step + 1)
            if done.all():
                break
            step_ids = token[:, None]  # (B, 1)
            generated = torch.cat([generated, step_ids], -1)
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], -1)
            positions = positions[:, -1:] + 1
        return {key: torch.stack([s[key] for s in steps], -1) for key in steps[0]}  # each (B, S)

    def _masks_steps(self, step_ids: torch.Tensor, mask: torch.Tensor, cache_name: str, cache) -> bool:
        """Whether the members' own ``generate`` passes the attention mask with each new token after the prompt, as
        their ``prepare_inputs_for_generation`` says: Mamba's drops it (its mixer multiplies the states by the mask,
        and one mask over the whole sequence beside one new token moved its logits by up to 2e-2, and the tokens of
        one-hot weights from the member's own). Where it cannot say, the mask is passed, as transformers' default."""
        try:
            prepared = self.model.model.prepare_inputs_for_generation(
                step_ids, attention_mask=mask, use_cache=True, is_first_iteration=False, **{cache_name: cache})
        except Exception:  # (a model's own preparation may want what a wide model's call does not give it)
            return True
        return not ("attention_mask" in prepared and prepared["attention_mask"] is None)

    def _member_continuations(self, batch, max_new_tokens: int, seed: int | None, generator: torch.Generator | None,
                              do_sample: bool, temperature: float | None, top_k: int | None, top_p: float | None,
                              eos_token_id: int | list[int] | None) -> torch.Tensor:
        """Each member's own continuation, ``(N, B, S)`` new tokens, from transformers' generate.

        Its sampling draws from torch's global generator: a draw runs under :data:`GLOBAL_RNG`, on that generator
        seeded from ``seed`` (else from ``generator``, else afresh) and given back as it was, so that calls from
        several threads neither draw each other's numbers nor leave the process reseeded."""
        options = {"do_sample": do_sample} if eos_token_id is None else {"do_sample": do_sample,
                                                                          "eos_token_id": eos_token_id}
        try:
            return self._generate(batch, max_new_tokens, seed, generator, options, temperature, top_k, top_p)
        except GenerationConfigsDiffer as exc:  # generate's way out (its options) is no option of the pipeline's
            raise ValueError(
                f"The members' generation configs differ ({exc.differences}): each member's own continuation "
                "(combine='none', return_members=True) runs one generate, which runs one generation config for every "
                "member. Make the settings every member's (a GenerationConfig assigned to "
                "pipe.model.generation_config is), or take the ensemble's continuation alone, which reads each "
                "member's own settings.") from None

    def _generate(self, batch, max_new_tokens: int, seed: int | None, generator: torch.Generator | None,
                  options: dict, temperature: float | None, top_k: int | None, top_p: float | None) -> torch.Tensor:
        if not options["do_sample"]:
            sequences = self.model.generate(**batch, max_new_tokens=max_new_tokens, pad_token_id=self._pad_id(),
                                            **options)
            return sequences[:, :, batch["input_ids"].shape[-1]:]
        options.update({k: v for k, v in dict(temperature=temperature, top_k=top_k, top_p=top_p).items()
                        if v is not None})
        if seed is None:
            seed = (torch.Generator().seed() if generator is None else
                    int(torch.randint(2**62, (), generator=generator, device=generator.device)))
        device = self.model.device
        with GLOBAL_RNG, torch.random.fork_rng(devices=[] if device.type == "cpu" else [device],
                                               device_type=None if device.type == "cpu" else device.type):
            torch.manual_seed(seed)
            sequences = self.model.generate(**batch, max_new_tokens=max_new_tokens, pad_token_id=self._pad_id(),
                                            **options)
        return sequences[:, :, batch["input_ids"].shape[-1]:]

    def _keeps_logits(self) -> bool:
        """Whether the model can compute logits for the last position only (most causal LMs can)."""
        return "logits_to_keep" in inspect.signature(self.model.model.forward).parameters


def _filter(probs: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """(B, V) probabilities restricted to the ``top_k`` most likely tokens and then to the smallest set
    holding ``top_p`` of the mass (always at least one token), renormalised."""
    if top_k is not None and top_k < probs.shape[-1]:
        kth = probs.topk(top_k, -1).values[:, -1:]  # (B, 1)
        probs = probs.masked_fill(probs < kth, 0)
    if top_p is not None and top_p < 1:
        ordered, order = probs.sort(-1, descending=True)
        before = ordered.cumsum(-1) - ordered  # mass of the more likely tokens
        ordered = ordered.masked_fill(before >= top_p * ordered.sum(-1, keepdim=True), 0)
        probs = torch.zeros_like(probs).scatter(-1, order, ordered)
    return probs / probs.sum(-1, keepdim=True)
