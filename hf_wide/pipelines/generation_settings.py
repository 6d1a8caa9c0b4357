"""What text generation reads of the members' generation configs: the logits processors each asks for, how many tokens
a prompt may get, and the special tokens (eos, bos, pad), for :class:`~hf_wide.pipelines.text_generation.
TextGenerationPipeline`."""

from __future__ import annotations

import copy

import torch

DEFAULT_NEW_TOKENS = 20
# Generation settings whose logits processors read a row's tokens from its start, left padding included, or count
# them: (name, the values that build no processor)
PADDING_READERS = (("repetition_penalty", (None, 1.0)), ("encoder_repetition_penalty", (None, 1.0)),
                   ("no_repeat_ngram_size", (None, 0)), ("encoder_no_repeat_ngram_size", (None, 0)),
                   ("min_length", (None, 0)), ("forced_bos_token_id", (None,)))


class GenerationSettings:
    """The members' generation settings, read for a pipeline over ``self.model`` (a WideModel) and
    ``self.tokenizer``."""

    def _member_processors(self, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int,
                           eos_token_id: int | list[int] | None) -> list | None:
        """Each member's logits processors, as transformers' generate builds them from its generation config
        (repetition penalty, n-grams not to repeat, bad words, a minimum length, suppressed and forced tokens):
        applied to each member's logits before they are combined. Sampling's warpers (temperature, top-k, top-p)
        are not: they apply to the combined distribution. None where no member has any."""
        from transformers import LogitsProcessorList

        model = self.model.model
        configs = self.model.member_generation_configs or [getattr(model, "generation_config", None)]
        if any(c is None for c in configs):
            return None
        built = []
        for i, config in enumerate(configs):
            config = copy.deepcopy(config)
            if config.guidance_scale not in (None, 1):
                raise ValueError(f"Member {i}'s generation config asks for classifier-free guidance (guidance_scale="
                                 f"{config.guidance_scale}), which ensemble decoding does not run.")
            if (config.num_beams or 1) > 1:
                raise ValueError(f"Member {i}'s generation config asks for beam search (num_beams={config.num_beams}), "
                                 "which ensemble decoding does not run (it chooses one token a step for all members): "
                                 "pass combine='none' for each member's own beam search.")
            config.update(do_sample=False, max_new_tokens=max_new_tokens)  # (no warpers)
            if eos_token_id is not None:  # given to the call: every member's, as generate(eos_token_id=) makes it
                config.eos_token_id = eos_token_id
            config.max_length = ids.shape[-1] + max_new_tokens
            if config.pad_token_id is None:
                config.pad_token_id = self._pad_id()
            model._prepare_special_tokens(config, True, device=ids.device)
            built.append(model._get_logits_processor(
                generation_config=config, input_ids_seq_length=ids.shape[-1], encoder_input_ids=ids,
                logits_processor=LogitsProcessorList(), device=ids.device, model_kwargs={"attention_mask": mask}))
        if not any(built):
            return None
        return built if len(built) == self.model.num_members else built * self.model.num_members

    def batch_keys(self, features: list[dict[str, torch.Tensor]]) -> list[tuple[int | None, int | None]]:
        """Each prompt's (length, new tokens) where the members' settings make its continuation depend on them: rows
        of other lengths or budgets then run in batches of their own, as each would alone. transformers' processors
        read the whole left-padded batch: a repetition penalty or n-gram ban reads the padding too (a pad token that
        is also the end token made less likely, and a row went on past where it ends alone), ``min_length`` and
        ``forced_bos_token_id`` count the padding as prompt, and ``forced_eos_token_id`` ends every row at the
        longest budget's end (a row of a shorter one lost its end token)."""
        configs = [c for c in self.model.member_generation_configs or
                   [getattr(self.model.model, "generation_config", None)] if c is not None]
        padding = any(getattr(c, name, None) not in absent for c in configs for name, absent in PADDING_READERS)
        budget = any(getattr(c, "forced_eos_token_id", None) is not None for c in configs)
        return [(f["input_ids"].shape[-1] if padding else None, int(f["new_tokens"].reshape(-1)[0]) if budget else None)
                for f in features]

    def _default_new_tokens(self, prompt_length: int) -> int:
        """New tokens for a prompt of ``prompt_length`` tokens, as transformers' generate counts them from the members'
        generation configs where they agree: their ``max_new_tokens``, else what their ``max_length`` leaves (a
        prompt of that length or more refused, as generate refuses it); else :data:`DEFAULT_NEW_TOKENS`."""
        configs = self.model.member_generation_configs or [getattr(self.model.model, "generation_config", None)]
        for name in ("max_new_tokens", "max_length"):
            values = {getattr(c, name, None) for c in configs}
            if len(values) == 1 and None not in values:
                value = values.pop()
                if name == "max_length" and value <= prompt_length:
                    raise ValueError(f"The prompt is {prompt_length} tokens long, and the members' generation configs "
                                     f"end every sequence at max_length={value} tokens: pass max_new_tokens=.")
                return value if name == "max_new_tokens" else value - prompt_length
        return DEFAULT_NEW_TOKENS

    # ---------------------------------------------------------------- special tokens
    def _eos_ids(self, given: int | list[int] | None = None) -> list[int]:
        """The tokens that end the ensemble's continuation: ``given`` to the call, else the members' (refused where
        their generation configs differ: one continuation cannot stop where each member would, and member 0's
        stopped a member with another eos past its own end)."""
        if given is not None:
            return [given] if isinstance(given, int) else list(given)
        configs = self.model.member_generation_configs or []
        ends = [_as_list(getattr(c, "eos_token_id", None)) for c in configs if c is not None]
        differ = next((i for i, end in enumerate(ends) if end != ends[0]), None)
        if differ is not None:
            raise ValueError(f"The members' generation configs end at different tokens (eos_token_id: member 0 "
                             f"{ends[0]}, member {differ} {ends[differ]}), and ensemble decoding makes one "
                             "continuation for all of them. Pass eos_token_id= to the pipeline to end it at the "
                             "same tokens for every member.")
        return self._configured_eos()

    def _generate_eos(self, given: int | list[int] | None = None) -> list[int]:
        """The tokens the members' own ``generate`` ends at: ``given`` to the call, else their generation configs'
        (alike: generate refuses members whose differ), and none where they have none (it runs to its budget,
        whatever end token the model's config or the tokenizer name)."""
        eos = given if given is not None else getattr(getattr(self.model.model, "generation_config", None),
                                                      "eos_token_id", None)
        return _as_list(eos.tolist() if isinstance(eos, torch.Tensor) else eos) or []

    def _configured_eos(self) -> list[int]:
        for source in (getattr(self.model.model, "generation_config", None), self.model.config, self.tokenizer):
            eos = getattr(source, "eos_token_id", None)
            if eos is not None:
                return [eos] if isinstance(eos, int) else list(eos)
        return []

    def _bos_id(self, prompt: str) -> int:
        """The token transformers' ``generate`` starts from without a prompt: the generation config's BOS."""
        for source in (getattr(self.model.model, "generation_config", None), self.model.config, self.tokenizer):
            bos = getattr(source, "bos_token_id", None)
            if bos is not None:
                return bos
        raise ValueError(f"The prompt {prompt!r} is no token to the tokenizer, and the members have no bos_token_id "
                         "to start from: give them some text they can read.")

    def _pad_id(self) -> int:
        for source in (getattr(self.model.model, "generation_config", None), self.tokenizer):
            pad = getattr(source, "pad_token_id", None)
            if pad is not None:
                return pad
        return (self._configured_eos() or [0])[0]


def _as_list(value) -> list | None:
    return [value] if isinstance(value, int) else None if value is None else list(value)
