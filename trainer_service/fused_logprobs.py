"""Token log-probabilities (and entropy) of the targets through the LM head, computed in tiles.

The unfused path builds the whole logits tensor, casts it to fp32, soft-caps it, divides it by the sampling
temperature and takes a log-softmax: at 8,192 tokens x 151,936 vocabulary that is several [N, V] fp32 tensors
(5 GB each) alive at once, plus as many again in the backward. Here a custom autograd function walks
[token_chunk, vocab_chunk] tiles of the logits:

- forward: per token an online log-sum-exp (running max, sum of exponentials) and the target's logit; with
  ``with_entropy`` also the running sum of ``exp(l - max) * (l - max)``, which gives ``H = log S - A / S``;
- backward: the tiles are recomputed, vocabulary tiles outside and token tiles inside, so that each vocabulary
  slice of the weight gradient is complete after one pass over the tokens and is written once in the weight's
  dtype (its fp32 accumulator is one [vocab_chunk, H] slice); the hidden-state gradient accumulates in fp32
  ([N, H], small next to [N, V]).

Only one tile of logits (and two or three of its temporaries) exists at a time. Logits are
``softcap(hidden @ weight.T) / divisor``: ``softcap(z) = cap * tanh(z / cap)`` (Beam's final logit soft-cap) and
one divisor per token (the sampling temperature of its row, ``batch.logit_divisors``), in that order, as the
unfused path computes them.

Vocabulary-parallel LM heads (megatron's tensor parallelism): each rank passes its own weight shard, its first
vocabulary index (``vocab_start``) and the process ``group``; the per-token statistics are combined with one
max and one sum all-reduce. The hidden-state gradient is then this shard's part: the caller sums it over the
group (megatron's ``copy_to_tensor_model_parallel_region`` does in its backward).

Shape legend: N tokens, H hidden, V vocabulary (this rank's shard), n / v the tokens / vocabulary of one tile.
"""

from __future__ import annotations

import torch

TOKEN_CHUNK = 4096
VOCAB_CHUNK = 16384


def fused_token_logprobs(
    hidden_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    targets_N: torch.Tensor,
    divisors_N: torch.Tensor | None = None,
    softcap: float | None = None,
    *,
    with_entropy: bool = False,
    vocab_start: int = 0,
    group=None,
    token_chunk: int = TOKEN_CHUNK,
    vocab_chunk: int = VOCAB_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of each target [N] (fp32), and the entropy of each token's distribution [N] or None.

    Args:
        hidden_NH: Final hidden states, one row per scored position.
        weight_VH: LM-head weight (this rank's vocabulary shard under tensor parallelism).
        targets_N: Global vocabulary index of each position's target token.
        divisors_N: What each position's logits are divided by (sampling temperature); None = 1.
        softcap: Final logit soft-cap ``cap * tanh(z / cap)``, applied before the divisor; None or 0 = off.
        with_entropy: Also return the entropy (differentiable).
        vocab_start: Global index of ``weight_VH``'s first row.
        group: Process group over which the vocabulary is split; None = all of it is here.
        token_chunk, vocab_chunk: Tile size.
    """
    _check_inputs(hidden_NH, weight_VH, targets_N, divisors_N, token_chunk, vocab_chunk)
    cap = float(softcap) if softcap else None
    logprobs_N, entropy_N = _FusedLMHeadLogprobs.apply(
        hidden_NH, weight_VH, targets_N, divisors_N, cap, with_entropy, vocab_start, group, token_chunk, vocab_chunk
    )
    return logprobs_N, (entropy_N if with_entropy else None)


def per_token_divisors(
    temperature: float | torch.Tensor | None, batch: int, positions: int, device
) -> torch.Tensor | None:
    """The sampling temperature as ``divisors_N`` of ``batch`` rows of ``positions`` tokens: one for all rows, or
    [B] per row (``batch.logit_divisors``). None where nothing is divided (None, 0 and 1, as ``temper``)."""
    if isinstance(temperature, torch.Tensor):
        return temperature.to(device=device, dtype=torch.float32)[:, None].expand(batch, positions).reshape(-1)
    if temperature is not None and temperature > 0 and temperature != 1.0:
        return torch.full((batch * positions,), float(temperature), device=device)
    return None


def reference_token_logprobs(
    hidden_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    targets_N: torch.Tensor,
    divisors_N: torch.Tensor | None = None,
    softcap: float | None = None,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The unfused computation on one rank (whole [N, V] logits in fp32): log-probabilities [N], entropies or None."""
    logits_NV = (hidden_NH @ weight_VH.T).float()
    if softcap:
        logits_NV = torch.tanh(logits_NV / softcap) * softcap
    if divisors_N is not None:
        logits_NV = logits_NV / divisors_N.to(logits_NV)[:, None]
    logprobs_NV = torch.log_softmax(logits_NV, dim=-1)
    entropy_N = -(logprobs_NV.exp() * logprobs_NV).sum(-1) if with_entropy else None
    return logprobs_NV.gather(-1, targets_N[:, None]).squeeze(-1), entropy_N


def _check_inputs(hidden_NH, weight_VH, targets_N, divisors_N, token_chunk: int, vocab_chunk: int) -> None:
    if hidden_NH.dim() != 2 or weight_VH.dim() != 2 or hidden_NH.shape[1] != weight_VH.shape[1]:
        raise ValueError(
            f"hidden_NH {tuple(hidden_NH.shape)} and weight_VH {tuple(weight_VH.shape)} must be 2-D with one hidden size"
        )
    if targets_N.shape != hidden_NH.shape[:1]:
        raise ValueError(f"targets_N shape {tuple(targets_N.shape)} != ({hidden_NH.shape[0]},)")
    if divisors_N is not None and divisors_N.shape != hidden_NH.shape[:1]:
        raise ValueError(f"divisors_N shape {tuple(divisors_N.shape)} != ({hidden_NH.shape[0]},)")
    if token_chunk < 1 or vocab_chunk < 1:
        raise ValueError(f"token_chunk {token_chunk} and vocab_chunk {vocab_chunk} must be >= 1")


def _group_size(group) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


class _Tiles:
    """What forward and backward share: the inputs, the tile sizes, and one tile's logits."""

    def __init__(self, hidden_NH, weight_VH, targets_N, divisors_N, cap, vocab_start, token_chunk, vocab_chunk):
        self.hidden_NH, self.weight_VH, self.cap = hidden_NH, weight_VH, cap
        self.local_targets_N = targets_N - vocab_start  # index into this shard; outside [0, V) elsewhere
        self.divisors_N = None if divisors_N is None else divisors_N.to(device=hidden_NH.device, dtype=torch.float32)
        self.token_chunk, self.vocab_chunk = token_chunk, vocab_chunk

    def token_ranges(self):
        num_tokens = self.hidden_NH.shape[0]
        return [(start, min(start + self.token_chunk, num_tokens)) for start in range(0, num_tokens, self.token_chunk)]

    def vocab_ranges(self):
        vocab = self.weight_VH.shape[0]
        return [(start, min(start + self.vocab_chunk, vocab)) for start in range(0, vocab, self.vocab_chunk)]

    def raw_logits(self, tokens: tuple[int, int], vocab: tuple[int, int]) -> torch.Tensor:
        """``hidden @ weight.T`` of one tile in fp32 (the matmul runs in the inputs' dtype)."""
        hidden_nH = self.hidden_NH[tokens[0] : tokens[1]]
        return (hidden_nH @ self.weight_VH[vocab[0] : vocab[1]].T).float()

    def divide(self, logits_nv: torch.Tensor, tokens: tuple[int, int]) -> torch.Tensor:
        if self.divisors_N is not None:
            logits_nv.div_(self.divisors_N[tokens[0] : tokens[1], None])
        return logits_nv

    def target_columns(self, tokens: tuple[int, int], vocab: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's target column in the tile (clamped) and whether the target lies in the tile."""
        column_n = self.local_targets_N[tokens[0] : tokens[1]] - vocab[0]
        inside_n = (column_n >= 0) & (column_n < vocab[1] - vocab[0])
        return column_n.clamp(0, vocab[1] - vocab[0] - 1), inside_n


class _FusedLMHeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, targets_N, divisors_N, cap, with_entropy, vocab_start, group, tc, vc):
        tiles = _Tiles(hidden_NH, weight_VH, targets_N, divisors_N, cap, vocab_start, tc, vc)
        num_tokens, device = hidden_NH.shape[0], hidden_NH.device
        max_N = torch.full((num_tokens,), float("-inf"), device=device)
        sum_N = torch.zeros(num_tokens, device=device)  # sum of exp(l - max)
        dot_N = torch.zeros(num_tokens, device=device)  # sum of exp(l - max) * (l - max)
        target_N = torch.zeros(num_tokens, device=device)
        for tokens in tiles.token_ranges():
            rows = slice(*tokens)
            for vocab in tiles.vocab_ranges():
                logits_nv = tiles.raw_logits(tokens, vocab)
                if cap is not None:
                    logits_nv.div_(cap).tanh_().mul_(cap)
                tiles.divide(logits_nv, tokens)
                column_n, inside_n = tiles.target_columns(tokens, vocab)
                picked_n = logits_nv.gather(1, column_n[:, None]).squeeze(1)
                target_N[rows] = torch.where(inside_n, picked_n, target_N[rows])
                _online_update(logits_nv, max_N[rows], sum_N[rows], dot_N[rows], with_entropy)
        max_N, sum_N, dot_N, target_N = _combine_over_ranks(max_N, sum_N, dot_N, target_N, group)
        log_sum_N = torch.log(sum_N)
        lse_N = max_N + log_sum_N
        mean_logit_N = max_N + dot_N / sum_N  # E_p[l]
        ctx.save_for_backward(hidden_NH, weight_VH, targets_N, divisors_N, lse_N, mean_logit_N)
        ctx.settings = (cap, with_entropy, vocab_start, tc, vc)
        entropy_N = log_sum_N - dot_N / sum_N if with_entropy else torch.zeros_like(lse_N)
        ctx.mark_non_differentiable(*(() if with_entropy else (entropy_N,)))
        return target_N - lse_N, entropy_N

    @staticmethod
    def backward(ctx, grad_logprobs_N, grad_entropy_N):
        hidden_NH, weight_VH, targets_N, divisors_N, lse_N, mean_logit_N = ctx.saved_tensors
        cap, with_entropy, vocab_start, tc, vc = ctx.settings
        tiles = _Tiles(hidden_NH, weight_VH, targets_N, divisors_N, cap, vocab_start, tc, vc)
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_lp_N = torch.zeros_like(lse_N) if grad_logprobs_N is None else grad_logprobs_N.float()
        grad_ent_N = grad_entropy_N.float() if with_entropy and grad_entropy_N is not None else None
        grad_hidden_NH = torch.zeros(hidden_NH.shape, dtype=torch.float32, device=hidden_NH.device)
        grad_weight_VH = torch.empty_like(weight_VH) if want_weight else None
        for vocab in tiles.vocab_ranges():
            weight_vH = weight_VH[vocab[0] : vocab[1]]
            slice_grad_vH = torch.zeros(weight_vH.shape, dtype=torch.float32, device=weight_vH.device)
            for tokens in tiles.token_ranges():
                rows = slice(*tokens)
                grad_nv = _tile_logit_grad(tiles, tokens, vocab, lse_N[rows], mean_logit_N[rows], grad_lp_N, grad_ent_N)
                grad_nv = grad_nv.to(weight_VH.dtype)
                if want_hidden:
                    grad_hidden_NH[rows] += (grad_nv @ weight_vH).float()
                if want_weight:
                    slice_grad_vH += (grad_nv.T @ hidden_NH[rows]).float()
            if want_weight:
                grad_weight_VH[vocab[0] : vocab[1]] = slice_grad_vH
        grad_hidden = grad_hidden_NH.to(hidden_NH.dtype) if want_hidden else None
        return grad_hidden, grad_weight_VH, None, None, None, None, None, None, None, None


def _online_update(logits_nv, max_n, sum_n, dot_n, with_entropy: bool) -> None:
    """Fold one tile into the running (max, sum, dot) of its rows, in place (``logits_nv`` is consumed).

    With ``S = sum exp(l - m)`` and ``A = sum exp(l - m) (l - m)`` over the keys seen so far, moving the reference
    from m to m' gives ``S' = s S`` and ``A' = s (A + (m - m') S)``, ``s = exp(m - m')``.
    """
    new_max_n = torch.maximum(max_n, logits_nv.amax(dim=1))
    scale_n = torch.exp(max_n - new_max_n)  # 0 on the first tile (max was -inf)
    logits_nv.sub_(new_max_n[:, None])
    exp_nv = logits_nv.exp()
    if with_entropy:
        shift_n = torch.where(sum_n > 0, (max_n - new_max_n) * sum_n, torch.zeros_like(sum_n))
        dot_n.copy_(scale_n * (dot_n + shift_n) + (exp_nv * logits_nv).sum(dim=1))
    sum_n.copy_(sum_n * scale_n + exp_nv.sum(dim=1))
    max_n.copy_(new_max_n)


def _combine_over_ranks(max_N, sum_N, dot_N, target_N, group):
    """Per-token statistics of the whole vocabulary from every rank's shard (one max, one sum all-reduce)."""
    if _group_size(group) == 1:
        return max_N, sum_N, dot_N, target_N
    import torch.distributed as dist

    global_max_N = max_N.clone()
    dist.all_reduce(global_max_N, op=dist.ReduceOp.MAX, group=group)
    scale_N = torch.exp(max_N - global_max_N)
    stacked_3N = torch.stack([sum_N * scale_N, scale_N * (dot_N + (max_N - global_max_N) * sum_N), target_N])
    dist.all_reduce(stacked_3N, group=group)  # the target's logit: only the rank holding it adds a non-zero
    return global_max_N, stacked_3N[0], stacked_3N[1], stacked_3N[2]


def _tile_logit_grad(tiles: _Tiles, tokens, vocab, lse_n, mean_logit_n, grad_lp_N, grad_ent_N) -> torch.Tensor:
    """d loss / d raw logits ``hidden @ weight.T`` of one tile, fp32 [n, v].

    ``d logprob / d l = onehot - p`` and ``d H / d l = -p (l - E_p[l])``; then through the divisor and the
    soft-cap (``d cap tanh(z / cap) / dz = 1 - tanh^2``).
    """
    rows = slice(*tokens)
    raw_nv = tiles.raw_logits(tokens, vocab)
    if tiles.cap is not None:
        tanh_nv = raw_nv.div_(tiles.cap).tanh_()
        logits_nv = tanh_nv * tiles.cap
        softcap_slope_nv = tanh_nv.square_().neg_().add_(1.0)
    else:
        logits_nv, softcap_slope_nv = raw_nv, None
    tiles.divide(logits_nv, tokens)
    probs_nv = logits_nv.sub(lse_n[:, None]).exp_()
    weight_nv = grad_lp_N[rows, None].expand_as(logits_nv)
    if grad_ent_N is not None:  # reuse the logits tile for g_lp + g_H (l - E[l])
        weight_nv = logits_nv.sub_(mean_logit_n[:, None]).mul_(grad_ent_N[rows, None]).add_(grad_lp_N[rows, None])
    grad_nv = probs_nv.mul_(weight_nv).neg_()
    column_n, inside_n = tiles.target_columns(tokens, vocab)
    grad_nv.scatter_add_(1, column_n[:, None], torch.where(inside_n, grad_lp_N[rows], 0.0)[:, None])
    if tiles.divisors_N is not None:
        grad_nv.div_(tiles.divisors_N[rows, None])
    if softcap_slope_nv is not None:
        grad_nv.mul_(softcap_slope_nv)
    return grad_nv
