import pytest
import torch
import torch.nn.functional as F

from blockspec.training.vocab_loss import head_cross_entropy, linear_cross_entropy, linear_soft_cross_entropy


def reference(hidden, weight, labels):
    logits = hidden @ weight.T
    return F.cross_entropy(logits, labels, reduction="none"), logits.argmax(-1) == labels


@pytest.mark.parametrize("rows,chunk", [(1, 4), (7, 3), (64, 16), (50, 256)])
def test_chunked_loss_and_gradients_equal_the_materialised_ones(rows, chunk):
    torch.manual_seed(rows)
    hidden = torch.randn(rows, 24, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(97, 24, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 97, (rows,))
    scale = torch.rand(rows, dtype=torch.float64)

    losses, hits = linear_cross_entropy(hidden, weight, labels, chunk_rows=chunk)
    (losses.double() * scale).sum().backward()
    grad_hidden, grad_weight = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    want_losses, want_hits = reference(hidden, weight, labels)
    (want_losses * scale).sum().backward()
    torch.testing.assert_close(losses.double(), want_losses, rtol=1e-5, atol=1e-5)
    assert torch.equal(hits, want_hits)
    torch.testing.assert_close(grad_hidden, hidden.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_weight, weight.grad, rtol=1e-5, atol=1e-6)


def test_a_frozen_head_gets_no_gradient_and_bf16_autocast_stays_close():
    torch.manual_seed(0)
    hidden = torch.randn(40, 32, requires_grad=True)
    head = torch.nn.Linear(32, 300, bias=False).requires_grad_(False)
    labels = torch.randint(0, 300, (40,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        losses, _ = head_cross_entropy(head, hidden, labels)
    losses.mean().backward()
    assert head.weight.grad is None and hidden.grad.dtype == torch.float32
    want, _ = reference(hidden.detach(), head.weight, labels)
    torch.testing.assert_close(losses, want, rtol=0.05, atol=0.05)


def test_a_head_with_a_bias_runs_as_it_is():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 20)
    hidden, labels = torch.randn(5, 8), torch.randint(0, 20, (5,))
    losses, hits = head_cross_entropy(head, hidden, labels)
    logits = head(hidden)
    torch.testing.assert_close(losses, F.cross_entropy(logits, labels, reduction="none"))
    assert torch.equal(hits, logits.argmax(-1) == labels)


def soft_reference(hidden, weight, teacher_hidden):
    teacher = (teacher_hidden @ weight.T).softmax(-1)
    return -(teacher * (hidden @ weight.T).log_softmax(-1)).sum(-1)


@pytest.mark.parametrize("rows,chunk", [(1, 4), (7, 3), (50, 16)])
def test_soft_cross_entropy_and_its_gradient_equal_the_materialised_ones(rows, chunk):
    torch.manual_seed(rows)
    hidden = torch.randn(rows, 24, dtype=torch.float64, requires_grad=True)
    teacher_hidden = torch.randn(rows, 24, dtype=torch.float64)
    weight = torch.randn(97, 24, dtype=torch.float64)
    labels = torch.randint(0, 97, (rows,))
    scale = torch.rand(rows, dtype=torch.float64)

    losses, hits = linear_soft_cross_entropy(hidden, weight, teacher_hidden, labels, chunk_rows=chunk)
    (losses.double() * scale).sum().backward()
    grad_hidden = hidden.grad.clone()
    hidden.grad = None

    want = soft_reference(hidden, weight, teacher_hidden)
    (want * scale).sum().backward()
    torch.testing.assert_close(losses.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(hits, (hidden @ weight.T).argmax(-1) == labels)
    torch.testing.assert_close(grad_hidden, hidden.grad, rtol=1e-5, atol=1e-6)


def test_a_one_hot_teacher_gives_the_hard_label_loss():
    torch.manual_seed(0)
    weight = torch.eye(16, 8) * 60.0  # teacher state e_i puts all its mass on token i
    hidden = torch.randn(6, 8, requires_grad=True)
    labels = torch.randint(0, 8, (6,))
    soft, _ = linear_soft_cross_entropy(hidden, weight, torch.eye(8)[labels], labels)
    hard, _ = linear_cross_entropy(hidden, weight, labels)
    torch.testing.assert_close(soft, hard, rtol=1e-4, atol=1e-4)
