"""A conversation over a context compressed once: each turn's question and answer stay in the cache for the next.

kvpress's pipeline answers ``questions=[...]`` independently: each answer is removed from the cache before the next
question. The CriticalKV paper's multi-turn protocol (its appendix B.5, SCBench) compresses the context once, before
the first question, and lets every later turn see the earlier questions and answers. :class:`Conversation` does that
on a kvpress pipeline (or a model and its tokenizer):

>>> chat = Conversation(pipe, context, press=CriticalAdaKVPress(SnapKVPress(0.5)))
>>> chat.ask("Who keeps the logbook?")
>>> chat.ask("Where is it kept?")   # sees the first question and its answer

The first turn is what kvpress's pipeline builds (the chat template's user turn holds the context then the
question); every later turn is the template's continuation after the previous answer (a new user turn, then the
assistant's header). Answers are greedy. Nothing is re-encoded: the cache holds the compressed context, then every
question and answer token as they were fed.

``ask(question, reference_answer=...)`` follows SCBench's protocol (golden history): the model answers, then its
answer is removed from the cache and the reference answer is fed in its place, teacher-forced, so the next turn
sees the reference; :attr:`Conversation.reference_scores` then holds the reference's per-token negative
log-likelihood and top-k log-probabilities (spans marked ``[[...]]`` are scored, the whole answer otherwise:
:func:`kvpress_critical.likelihood.target_tokens`). ``max_new_tokens=0`` only feeds and scores the reference.

The context is compressed once, by ``press``, before the first question, and turns are never compressed: a press
that compresses while decoding (kvpress's ``DecodingPress``, ``PrefillDecodingPress`` with a decoding press, a
``CompactCachePress`` around one) is refused. Positions are logical: a compressed
cache is shorter than the tokens it has seen, and RoPE continues after them.

In kvpress's masking layout (a head-wise press alone), the multi-token turns attend over the unmasked entries
exactly (:func:`kvpress_critical.cache.attention.attention_wrapping` with ``exact_masking``), so answers do not depend
on the layout: the masking and the compact layouts give the same answers (tested).
"""

from __future__ import annotations

from contextlib import ExitStack, nullcontext

import torch
from transformers import DynamicCache

from kvpress_critical.cache.attention import attention_wrapping
from kvpress_critical.modeling import attention_modules

__all__ = ["Conversation"]


class Conversation:
    """
    A conversation over ``context``, compressed once by ``press`` (module docstring).

    Parameters
    ----------
    pipe : kvpress's ``"kv-press-text-generation"`` pipeline, or a ``(model, tokenizer)`` pair
        The model and the way the pipeline formats the context and the first question.
    context : str
        The context, prefilled and compressed when the conversation starts.
    press : BasePress, optional
        The press that compresses the context (None: the full cache).
    cache : Cache, optional
        The cache to fill (default: a new ``DynamicCache``).
    max_context_length : int, optional
        Keep the context's first tokens only, as kvpress's pipeline does.
    """

    def __init__(self, pipe, context: str, press=None, cache=None, max_context_length: int | None = None):
        if press is not None:
            from kvpress_critical.capabilities import conversation_refusal

            refusal = conversation_refusal(press)
            if refusal is not None:
                raise ValueError(refusal)
        if isinstance(pipe, tuple):
            import kvpress  # noqa: F401  (registers the pipeline)
            from transformers import pipeline

            model, tokenizer = pipe
            pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
        self.pipe, self.model, self.tokenizer = pipe, pipe.model, pipe.tokenizer
        self.press = press
        self.cache = DynamicCache() if cache is None else cache
        self.turns: list[tuple[str, str]] = []  # (question, the answer the cache holds)
        self.answers: list[str] = []  # the model's greedy answers
        self.reference_scores = None  # TokenScores of the last reference answer
        self.reference_logp = None  # (L, V) its log-probabilities at the scored positions (for a KL)
        self._context = context
        inputs = pipe.preprocess(context, [""], "", max_context_length or int(1e10))
        self.position = inputs["context_ids"].shape[1]  # logical positions seen
        for module in attention_modules(self.model):  # a selection left by an earlier conversation is not this one's
            module.masked_key_indices = None
        with torch.no_grad(), press(self.model) if press is not None else nullcontext():
            self.model.model(input_ids=inputs["context_ids"].to(self.model.device), past_key_values=self.cache)
        self.context_length = self.position

    @property
    def context_tokens(self) -> int:
        """Tokens of the context, before compression."""
        return self.context_length

    def _turn_ids(self, question: str) -> torch.Tensor:
        """The tokens of the next turn: the first question as kvpress formats it, later ones the template's
        continuation after the previous answer."""
        if not self.turns:
            return self.pipe.preprocess(self._context, [question], "", int(1e10))["questions_ids"][0]
        if self.tokenizer.chat_template is None:
            text = "\n" + question + "\n"
        else:
            messages = [{"role": "user", "content": self._context + self.turns[0][0]}]
            for i, (q, a) in enumerate(self.turns):
                if i:
                    messages.append({"role": "user", "content": q})
                messages.append({"role": "assistant", "content": a})
            # what the cache holds ends with the last answer: the template's text after it closes that turn and
            # opens the new one (templates that trim a message's content, as Llama 3's, render the answer without
            # its surrounding whitespace: the cache keeps it, the continuation follows the trimmed text)
            opened = self.tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
            full = self.tokenizer.apply_chat_template(
                messages + [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
            )
            held = self.turns[-1][1]
            rendered = next(
                (opened + a for a in (held, held.strip(), held.rstrip(), held.lstrip()) if full.startswith(opened + a)),
                None,
            )
            if rendered is None:
                raise ValueError(
                    "the tokenizer's chat template renders an earlier turn differently once a new one follows: the "
                    "conversation cannot be continued token for token"
                )
            text = full[len(rendered) :]
        return self.tokenizer.encode(text, return_tensors="pt", add_special_tokens=False)

    @torch.no_grad()
    def ask(self, question: str, max_new_tokens: int = 50, reference_answer: str | None = None) -> str:
        """
        Feed ``question``, answer it greedily (at most ``max_new_tokens`` tokens) and return the answer. The cache
        keeps the question and the answer, or, with ``reference_answer``, the question and that answer instead
        (teacher-forced and scored into :attr:`reference_scores`; module docstring).
        """
        from kvpress_critical.likelihood import target_tokens

        ids = self._turn_ids(question).to(self.model.device)
        eos = self.model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, (list, tuple)) else [eos])
        generated: list[int] = []
        with ExitStack() as stack:
            if any(getattr(m, "masked_key_indices", None) is not None for m in attention_modules(self.model)):
                stack.enter_context(attention_wrapping(exact_masking=True))  # the masking layout, attended exactly
            last = question_logits = self._feed(ids)  # the question: logits of the answer's first token
            after_question = (self.position, [layer.get_seq_length() for layer in self.cache.layers])
            for step in range(max_new_tokens):
                token = int(last[0, -1].argmax())
                if token in eos:
                    break
                generated.append(token)
                if step + 1 < max_new_tokens or reference_answer is None:  # the cache holds the whole answer
                    last = self._feed(torch.tensor([[token]], device=self.model.device))
            answer = self.tokenizer.decode(generated, skip_special_tokens=True)
            held = answer
            if reference_answer is not None:
                self.position, lengths = after_question
                for layer, length in zip(self.cache.layers, lengths):
                    layer.crop(length)  # the model's answer goes; the question stays
                target_ids, scored = target_tokens(self.tokenizer, reference_answer)
                logits = self._feed(target_ids.to(self.model.device), all_logits=True)
                self.reference_scores = self._scores(question_logits, logits, target_ids, scored)
                held = self.tokenizer.decode(target_ids[0], skip_special_tokens=True)
        self.turns.append((question, held))
        self.answers.append(answer)
        return answer

    def _feed(self, ids: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        """Feed ``ids`` at the next logical positions; the logits of the last token (all of them if asked)."""
        positions = torch.arange(self.position, self.position + ids.shape[1], device=self.model.device)
        out = self.model(
            input_ids=ids,
            past_key_values=self.cache,
            position_ids=positions.unsqueeze(0),
            logits_to_keep=0 if all_logits else 1,
        )
        self.position += ids.shape[1]
        return out.logits

    def _scores(self, question_logits, logits, ids, scored):
        """Teacher-forced scores of ``ids`` (``(1, L)``): the question's last logits predict the first token."""
        from kvpress_critical.likelihood import TOP_K, TokenScores

        predicting = torch.cat([question_logits[0, -1:], logits[0, :-1]], dim=0)  # (L, V)
        logp = torch.log_softmax(predicting[scored.to(predicting.device)].float(), dim=-1)
        tokens = ids[0].to(logp.device)[scored.to(logp.device)]
        nll = -logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        top = logp.topk(min(TOP_K, logp.shape[-1]), dim=-1)
        self.reference_logp = logp.cpu()
        return TokenScores(nll.cpu(), top.indices.cpu(), top.values.cpu())
