"""Cross-entropy through a vocabulary-wide LM head, computed in row chunks.

A drafter's loss reads the target's LM head over tens of thousands of tokens. Written as
``F.cross_entropy(hidden @ W.T, labels)`` it materialises [N, V] logits, their float copy,
their log-softmax and its gradient: on a CPU those passes over memory cost more than the
matrix products. Here each chunk of rows is projected and reduced to (loss, argmax, softmax)
with as few passes over the [chunk, V] logits as the arithmetic allows; the softmax is kept
(in the compute dtype) and becomes the gradient of the hidden states (and of the head, when
it trains) in one product.
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK_ROWS = 256


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.LongTensor,
                         chunk_rows: int = DEFAULT_CHUNK_ROWS) -> tuple[torch.Tensor, torch.BoolTensor]:
    """Per-row cross-entropy of ``hidden @ weight.T`` against ``labels``, and whether each row's argmax hits.

    hidden [N, D], weight [V, D], labels [N]. Returns (losses [N] float32, hits [N] bool). The
    products run in the autocast dtype when autocast is on (else in ``hidden``'s dtype); the
    softmax is always float32. Gradients flow to ``hidden`` and, if it requires them, ``weight``.
    """
    return _LinearCrossEntropy.apply(hidden, weight, labels, chunk_rows, _compute_dtype(hidden))


def head_cross_entropy(head: torch.nn.Module, hidden: torch.Tensor, labels: torch.LongTensor):
    """``linear_cross_entropy`` through an LM head module; a head that is not a bias-free
    ``nn.Linear`` runs as it is (its logits materialised)."""
    if type(head) is torch.nn.Linear and head.bias is None:
        return linear_cross_entropy(hidden, head.weight, labels)
    logits = head(hidden).float()
    losses = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    return losses, logits.detach().argmax(dim=-1) == labels


class _LinearCrossEntropy(torch.autograd.Function):
    """Forward keeps each chunk's softmax (in the compute dtype): the backward pass needs only
    softmax - onehot, so it never recomputes the logits."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_rows, compute_dtype):
        head, rows = weight.to(compute_dtype), hidden.shape[0]
        losses, hits, probs = _outputs(hidden, weight, compute_dtype)
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            for chunk in _chunks(rows, chunk_rows):
                logits = (hidden[chunk].to(compute_dtype) @ head.T).float()
                top, argmax = logits.max(dim=-1)
                hits[chunk] = argmax == labels[chunk]
                label_logits = logits.gather(1, labels[chunk, None]).squeeze(1)
                exp = torch.exp(logits.sub_(top[:, None]))
                total = exp.sum(dim=-1)
                losses[chunk] = torch.log(total) + top - label_logits
                probs[chunk] = exp.div_(total[:, None])
        ctx.save_for_backward(hidden, weight, labels, probs)
        ctx.compute_dtype = compute_dtype
        ctx.mark_non_differentiable(hits)
        return losses, hits

    @staticmethod
    def backward(ctx, grad_losses, _grad_hits):
        hidden, weight, labels, probs = ctx.saved_tensors
        # d loss_i / d logits_i = softmax_i - onehot(label_i), times the incoming gradient of row i
        probs[torch.arange(probs.shape[0], device=probs.device), labels] -= 1.0
        scale = grad_losses.float()[:, None]
        grad_hidden = grad_weight = None
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                grad_hidden = ((probs @ weight.to(ctx.compute_dtype)).float() * scale).to(hidden.dtype)
            if ctx.needs_input_grad[1]:
                scaled = (probs.float() * scale).to(ctx.compute_dtype)
                grad_weight = (scaled.T @ hidden.to(ctx.compute_dtype)).to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def _outputs(hidden, weight, compute_dtype):
    """Per-row losses (float32) and hits, and the [rows, vocabulary] buffer the backward pass reads."""
    rows, device = hidden.shape[0], hidden.device
    return (torch.empty(rows, dtype=torch.float32, device=device), torch.empty(rows, dtype=torch.bool, device=device),
            torch.empty((rows, weight.shape[0]), dtype=compute_dtype, device=device))


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The autocast dtype when autocast is on, else the hidden states' own."""
    device_type = hidden.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype


def _chunks(rows: int, size: int):
    for start in range(0, rows, size):
        yield slice(start, min(rows, start + size))


def linear_soft_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, teacher_hidden: torch.Tensor,
                              labels: torch.LongTensor, chunk_rows: int = DEFAULT_CHUNK_ROWS):
    """Per-row cross-entropy of ``softmax(hidden @ weight.T)`` against the teacher's whole distribution
    ``softmax(teacher_hidden @ weight.T)`` (the target's next-token distribution through the same head),
    and whether each row's argmax hits ``labels``.

    Equal to ``linear_cross_entropy`` when the teacher is one-hot on the label; it differs from the
    KL divergence by the teacher's entropy, a constant. Gradients flow to ``hidden`` only.
    """
    return _LinearSoftCrossEntropy.apply(hidden, weight.detach(), teacher_hidden.detach(), labels, chunk_rows,
                                        _compute_dtype(hidden))


class _LinearSoftCrossEntropy(torch.autograd.Function):
    """Forward keeps softmax(student) - softmax(teacher) per chunk: exactly the gradient of the logits."""

    @staticmethod
    def forward(ctx, hidden, weight, teacher_hidden, labels, chunk_rows, compute_dtype):
        head, rows = weight.to(compute_dtype), hidden.shape[0]
        losses, hits, residual = _outputs(hidden, weight, compute_dtype)
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            for chunk in _chunks(rows, chunk_rows):
                log_student = (hidden[chunk].to(compute_dtype) @ head.T).float().log_softmax(dim=-1)
                teacher = (teacher_hidden[chunk].to(compute_dtype) @ head.T).float().softmax(dim=-1)
                hits[chunk] = log_student.argmax(dim=-1) == labels[chunk]
                losses[chunk] = -(teacher * log_student).sum(dim=-1)
                residual[chunk] = log_student.exp_().sub_(teacher)
        ctx.save_for_backward(weight, residual)
        ctx.compute_dtype = compute_dtype
        ctx.hidden_dtype = hidden.dtype
        ctx.mark_non_differentiable(hits)
        return losses, hits

    @staticmethod
    def backward(ctx, grad_losses, _grad_hits):
        weight, residual = ctx.saved_tensors
        grad_hidden = None
        if ctx.needs_input_grad[0]:
            with torch.autocast(device_type=residual.device.type, enabled=False):
                product = (residual @ weight.to(ctx.compute_dtype)).float()
                grad_hidden = (product * grad_losses.float()[:, None]).to(ctx.hidden_dtype)
        return grad_hidden, None, None, None, None, None
