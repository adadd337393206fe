#!/usr/bin/env python3
"""Write the reference fixtures that hypertrain's Qwen2-MoE tests compare against.

For each case, a small random Qwen2-MoE model (Qwen2MoeForCausalLM, float32,
eager attention, eager experts) is saved to tests/fixtures/moe/<case>/ with
save_pretrained(save_original_format=False) (config.json + model.safetensors;
generation_config.json is removed), next to fixture.safetensors.

Cases (shared: vocab 100, hidden 48, 4 heads, 2 KV heads, intermediate 112 in
the dense layers, moe_intermediate 32, shared_expert_intermediate 40, 8
experts, qkv_bias, router_aux_loss_coef 0.1, max positions 64, rope_theta
1e4, rms_norm_eps 1e-6, no sliding window):

  moe_untied     3 layers, mlp_only_layers [1], decoder_sparse_step 1
                 (layers 0, 2 MoE; layer 1 dense), top-k 2,
                 norm_topk_prob false, untied LM head
  moe_tied_norm  2 layers, mlp_only_layers [], decoder_sparse_step 2
                 (layer 0 dense, layer 1 MoE), top-k 3, norm_topk_prob true,
                 tied LM head (no lm_head.weight)

fixture.safetensors (F32 unless said; <l> is a MoE layer's index in the model,
e.g. routing.0 and routing.2 for moe_untied, routing.1 for moe_tied_norm):

  inputs              I32 (B, T)     tokens fed to the model (B=2, T=13)
  targets             I32 (B, T)     next tokens (inputs shifted by one)
  logits              F32 (B, T, V)  model(input_ids=inputs).logits
  loss                F32 (1,)       mean cross entropy of logits vs targets
                                     (F.cross_entropy, not labels=)
  grad.<name>         F32            d loss / d param, for every name in
                                     model.named_parameters()
  aux_loss            F32 (1,)       outputs.aux_loss with
                                     output_router_logits=True (formula below)
  loss_aux            F32 (1,)       loss + router_aux_loss_coef * aux_loss
  grad_aux.<name>     F32            d loss_aux / d param, every parameter
  routing.<l>         I32 (B*T, k)   the router's torch.topk indices, in
                                     topk's order (descending probability);
                                     row r is token (r // T, r % T)
  router_margin.<l>   F32 (B*T,)     p_(k) - p_(k+1): the k-th minus the
                                     (k+1)-th largest router probability
                                     (softmax of the logits in FP32)
  small.inputs        I32 (1, 3)     a second batch of 3 tokens: 3 * k slots
  small.targets       I32 (1, 3)     for 8 experts, drawn so that in every
                                     MoE layer at least one expert gets no
                                     token (checked)
  small.logits        F32 (1, 3, V)
  small.loss          F32 (1,)       mean cross entropy, as loss
  small.grad.<name>   F32            d small.loss / d param; the gate_up_proj
                                     and down_proj slices of the idle experts
                                     are exactly zero (checked)
  small.routing.<l>   I32 (3, k)     as routing.<l>
  bf16.logits         F32 (B, T, V)  transformers itself after
                                     model.to(torch.bfloat16), on the main
                                     batch (its bf16 logits widened to F32)
  bf16.loss           F32 (1,)       F.cross_entropy(bf16.logits, targets),
                                     computed in FP32
  bf16.routing.<l>    I32 (B*T, k)   the bf16 model's top-k indices; the same
                                     expert set as routing.<l> for every token
                                     (checked)

Parameter names (model.safetensors holds exactly these, 3-D experts, checked):

  model.layers.<l>.mlp.gate.weight                       (E, H) router
  model.layers.<l>.mlp.experts.gate_up_proj              (E, 2I, H): rows
      [0, I) of expert e are gate_proj, rows [I, 2I) up_proj
  model.layers.<l>.mlp.experts.down_proj                 (E, H, I)
  model.layers.<l>.mlp.shared_expert.{gate,up}_proj.weight (Is, H)
  model.layers.<l>.mlp.shared_expert.down_proj.weight    (H, Is)
  model.layers.<l>.mlp.shared_expert_gate.weight         (1, H)
  model.layers.<d>.mlp.{gate,up,down}_proj.weight        dense layers, as Qwen2
  ... self_attn.{q,k,v}_proj.{weight,bias}, o_proj.weight, norms, embed_tokens,
  lm_head (untied only), as in make_model_fixtures.py.

save_pretrained's default (save_original_format=True) reverts the experts to
the legacy per-expert layout (model.layers.<l>.mlp.experts.<e>.{gate,up,
down}_proj.weight, 2-D, 91 tensors for moe_untied instead of 47); this script
passes save_original_format=False to keep the 3-D tensors above.
from_pretrained reads either layout.

MoE block, as transformers computes it (x: the post-attention-norm rows,
(N, H), N = B*T):

  z      = x @ W_gate^T                       router logits (N, E)
  p      = softmax(z) in FP32; (v, idx) = torch.topk(p, k)
  w      = v / v.sum(-1) if norm_topk_prob else v;  w cast to x's dtype
  y[t]   = sum_j w[t, j] * down_e (silu(gate_e x_t) * up_e x_t), e = idx[t, j]
           (eager: experts visited in increasing index, each adds its rows
           with index_add_ into a zeros tensor of x's dtype)
  out    = y + sigmoid(x @ W_sg^T) * shared_expert(x)

In the bf16 model (model.to(torch.bfloat16), as stored under bf16.*; seen
with torch 2.15 on CPU, not asserted by the script): z comes out of a bf16
GEMM; softmax, topk and the norm_topk_prob division run in FP32 and w is then
rounded to bf16; each expert's output is multiplied by w in bf16; index_add_
into the bf16 zeros tensor rounds after every expert, in increasing expert
index. With k = 2 that equals one FP32 sum rounded once (the first add is
exact); with k = 3 (moe_tied_norm) it differs from it in 293 of the 1248
values of the MoE output, and from adding in topk's order too. The shared
expert, its sigmoid gate and the final sum are bf16 as well.

Aux loss (transformers' load_balancing_loss_func, no attention mask): over the
MoE layers only (outputs.router_logits has one (N, E) tensor per MoE layer;
dense layers contribute nothing), with L_moe MoE layers and R = L_moe * N rows,

  count_e  = sum over MoE layers l, tokens t, j < k of [idx_l[t, j] == e]
  P_e      = sum over MoE layers l, tokens t of softmax(z_l[t])_e
  aux_loss = E * sum_e (count_e / R) * (P_e / R)

The counts and probability sums are pooled over layers before the product
(not a mean of per-layer losses). count_e sums to k * R, so perfectly
balanced routing gives aux_loss = k, not 1. count is a histogram with no
gradient: d aux / d z flows through P only (the router weights and everything
upstream of each MoE layer's router). The script re-implements this formula
in float64 from the routers' logits and asserts it matches outputs.aux_loss
to 1e-6. With bf16 logits load_balancing_loss_func takes its softmax in bf16
(no dtype= there, unlike the router) and its own topk on that.

Experts implementation: Qwen2MoeExperts is wrapped by
@use_experts_implementation, which dispatches on config._experts_implementation;
transformers 5.24 defaults to "grouped_mm" when nothing is asked. The script
passes experts_implementation="eager" to from_config and from_pretrained
(the model's original per-expert loop; checked on model.config). The choice
is not written to config.json. grouped_mm (sums the k contributions in FP32)
gives the same logits for moe_untied (k = 2), and for moe_tied_norm logits
2.4e-7 apart in FP32 and up to 0.0078 apart in bf16.

Weights: redrawn N(0, 0.1) (norm weights 1 + N(0, 0.1)) as in
make_model_fixtures.py, except the routers (mlp.gate.weight), drawn
N(0, ROUTER_STD = 0.2) and then fitted so that bf16 rounding cannot flip an
expert choice. Random routers alone do not get there: at any std from 0.1 to
0.8, 40 seeds each, no draw had all 26 x L_moe main-batch margins >= 0.02
(best 0.0095). Layer by layer, for every main-batch token whose margin
p_(k) - p_(k+1) is below MARGIN = 0.05, the logits of its experts ranked
k+1..E are lowered by the smallest d (bisection, float64) that makes the
margin 0.05; that change, made zero-mean per token (softmax ignores a
constant), is dz, and the router becomes W + dW with dW the minimum-norm
least-squares solution (float64) of x @ dW^T = dz, x being the router's
main-batch input rows (N = 26 < H = 48, so the fit is exact). The other
tokens keep their probabilities, and the order inside each top k is the one
drawn. An attempt is discarded and the case's seed advanced by 1000 if a
margin cannot reach 0.05 (as d grows it tends to p_(k) / (p_(1) + ... +
p_(k))), if two probabilities inside a top k are closer than INNER_GAP = 1e-3
(topk's order would hang on rounding), if the small batch leaves no expert
idle in some MoE layer, or if the bf16 model sends a main-batch token to
another expert set. Both cases pass at their first seed (11 and 12); the
script prints the seed, the number of tokens corrected and |dW| / |W|.
The main batch's smallest margin is then 0.04999992 (0.05 less float32
rounding) in every MoE layer.

Every run with the same library versions writes the same bytes (fixed seeds,
one thread, a single metadata key).
Usage: python3 tools/reference/make_moe_fixtures.py [OUT_DIR]
"""

import copy
import os
import sys

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, Qwen2MoeConfig
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_model_fixtures import B, T  # noqa: E402  same batch shape as the dense fixtures

T_SMALL = 3  # 3 tokens x top-k (2 or 3) slots: some of the 8 experts get none
ROUTER_STD = 0.2
MARGIN = 0.05  # router margin the fit aims for (the brief's floor is 0.02)
MIN_MARGIN = 0.02
INNER_GAP = 1e-3  # smallest gap between the probabilities inside a top k
ATTEMPTS = 20

SIZES = dict(
    vocab_size=100,
    hidden_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=112,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=40,
    num_experts=8,
    qkv_bias=True,
    router_aux_loss_coef=0.1,  # large on purpose: the aux gradient shows
    max_position_embeddings=64,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    use_sliding_window=False,
)

# (case, extra config fields, seed)
CASES = [
    ("moe_untied",
     dict(num_hidden_layers=3, mlp_only_layers=[1], decoder_sparse_step=1,
          num_experts_per_tok=2, norm_topk_prob=False, tie_word_embeddings=False), 11),
    ("moe_tied_norm",
     dict(num_hidden_layers=2, mlp_only_layers=[], decoder_sparse_step=2,
          num_experts_per_tok=3, norm_topk_prob=True, tie_word_embeddings=True), 12),
]


def make_config(extra):
    cfg = Qwen2MoeConfig(**SIZES, **extra)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    return cfg


def redraw_params(model, gen):
    """Replace the default init (near-zero biases, unit norms) with values
    large enough that a wrong bias, norm or transpose changes the logits."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("mlp.gate.weight"):
                p.copy_(ROUTER_STD * noise)
            else:
                p.copy_(0.1 * noise)


def routers(model):
    """{layer index: router module} for the MoE layers, in layer order."""
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, Qwen2MoeTopKRouter):
            out[int(name.split(".")[2])] = mod  # model.layers.<l>.mlp.gate
    return dict(sorted(out.items()))


class RouterTap:
    """Records each router's input rows, logits and top-k indices."""

    def __init__(self, model):
        self.rec = {}
        self.handles = [
            mod.register_forward_hook(self._hook(layer))
            for layer, mod in routers(model).items()
        ]

    def _hook(self, layer):
        def hook(mod, args, out):
            logits, _, idx = out
            self.rec[layer] = (args[0].detach(), logits.detach(), idx.detach())
        return hook

    def close(self):
        for h in self.handles:
            h.remove()


def run(model, inputs, **kw):
    tap = RouterTap(model)
    try:
        out = model(input_ids=inputs, use_cache=False, **kw)
    finally:
        tap.close()
    return out, tap.rec


def margins(logits, k):
    p = torch.softmax(logits.float(), dim=-1).sort(dim=-1, descending=True).values
    return p[:, k - 1] - p[:, k]


def lowered(zs, k, d):
    """zs: one token's logits sorted descending (float64), the logits of the
    experts ranked k+1..E lowered by d."""
    out = zs.clone()
    out[k:] -= d
    return out


def margin_of(zs, k):
    p = torch.softmax(zs, dim=-1)
    return (p[k - 1] - p[k]).item()


def fit_routers(model, inputs, k):
    """Correct each router (layer by layer) so that every token of `inputs`
    has margin >= MARGIN. Returns {layer: (tokens corrected, |dW| / |W|)},
    or None if some token cannot get there."""
    stats = {}
    for layer, gate in routers(model).items():
        with torch.no_grad():
            _, rec = run(model, inputs)
        x, z, _ = rec[layer]
        x, z = x.double(), z.double()
        dz = torch.zeros_like(z)
        for t in range(z.shape[0]):
            order = torch.argsort(z[t], descending=True, stable=True)
            zs = z[t, order]
            if margin_of(zs, k) >= MARGIN:
                continue
            # the margin tends to p_(k) / (p_(1) + ... + p_(k)) as d grows
            lo, hi = 0.0, 16.0
            if margin_of(lowered(zs, k, hi), k) < MARGIN:
                return None
            for _ in range(60):
                mid = 0.5 * (lo + hi)
                if margin_of(lowered(zs, k, mid), k) >= MARGIN:
                    hi = mid
                else:
                    lo = mid
            dz[t, order] = lowered(zs, k, hi) - zs
            # softmax ignores a constant: the zero-mean change is the smallest
            dz[t] -= dz[t].mean()
        # min-norm dW with x @ dW^T = dz  (x: (N, H), N < H)
        dw_t = torch.linalg.lstsq(x, dz, driver="gelsd").solution  # (H, E)
        with torch.no_grad():
            w0 = gate.weight.double()
            gate.weight.copy_((w0 + dw_t.T).float())
        stats[layer] = (int(dz.any(dim=-1).sum()), (dw_t.norm() / w0.norm()).item())
    return stats


def inner_gap(logits, k):
    """Smallest gap between consecutive probabilities inside each top k."""
    p = torch.softmax(logits.float(), dim=-1).sort(dim=-1, descending=True).values[:, :k]
    return (p[:, :-1] - p[:, 1:]).min().item()


def build(case, extra, seed):
    """One attempt: model, batches and bf16 outputs, or None if it fails."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    cfg = make_config(extra)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager",
                                             experts_implementation="eager",
                                             dtype=torch.float32)
    assert model.config._experts_implementation == "eager"
    redraw_params(model, gen)
    model.train()  # dropout is 0.0; train mode only matters for the cache

    V, k = cfg.vocab_size, cfg.num_experts_per_tok
    tokens = torch.randint(0, V, (B, T + 1), generator=gen)
    small = torch.randint(0, V, (1, T_SMALL + 1), generator=gen)
    fit = fit_routers(model, tokens[:, :-1], k)
    if fit is None:
        return None

    with torch.no_grad():
        out, rec = run(model, tokens[:, :-1])
        _, rec_small = run(model, small[:, :-1])
    if min(margins(z, k).min().item() for _, z, _ in rec.values()) < MIN_MARGIN:
        return None
    if min(inner_gap(z, k) for _, z, _ in rec.values()) < INNER_GAP:
        return None  # topk's order inside the k would hang on rounding
    for layer, (_, _, idx) in rec_small.items():
        if torch.unique(idx).numel() == cfg.num_experts:
            return None  # every expert got a token: draw again

    bf = copy.deepcopy(model).to(torch.bfloat16)
    with torch.no_grad():
        out_bf, rec_bf = run(bf, tokens[:, :-1], output_router_logits=True)
    for layer, (_, _, idx) in rec.items():
        if not torch.equal(idx.sort(dim=-1).values, rec_bf[layer][2].sort(dim=-1).values):
            return None
    return dict(cfg=cfg, model=model, tokens=tokens, small=small, out_bf=out_bf,
                rec_bf=rec_bf, fit=fit)


def aux_reference(router_logits, num_experts, k):
    """load_balancing_loss_func's formula, independently, in float64."""
    count = torch.zeros(num_experts, dtype=torch.float64)
    prob = torch.zeros(num_experts, dtype=torch.float64)
    rows = 0
    for z in router_logits:
        p = torch.softmax(z.double(), dim=-1)
        idx = torch.topk(p, k, dim=-1).indices
        count += torch.bincount(idx.reshape(-1), minlength=num_experts).double()
        prob += p.sum(dim=0)
        rows += z.shape[0]
    return num_experts * torch.sum((count / rows) * (prob / rows))


def grads(model, prefix):
    out = {}
    for name, p in model.named_parameters():
        out[prefix + name] = p.grad.detach().float().contiguous()
    model.zero_grad(set_to_none=True)
    return out


def make_case(out_dir, case, extra, seed):
    for attempt in range(ATTEMPTS):
        got = build(case, extra, seed + 1000 * attempt)
        if got is not None:
            break
    else:
        sys.exit(f"{case}: no seed in {ATTEMPTS} attempts met the routing conditions")
    used_seed = seed + 1000 * attempt
    cfg, model, tokens, small = got["cfg"], got["model"], got["tokens"], got["small"]
    V, k, E = cfg.vocab_size, cfg.num_experts_per_tok, cfg.num_experts
    moe_layers = list(routers(model))
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    s_inputs, s_targets = small[:, :-1].contiguous(), small[:, 1:].contiguous()

    tensors = {"inputs": inputs.to(torch.int32), "targets": targets.to(torch.int32)}

    # CE only.
    out, rec = run(model, inputs)
    logits = out.logits  # (B, T, V)
    loss = F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))
    loss.backward()
    tensors["logits"] = logits.detach().float().contiguous()
    tensors["loss"] = loss.detach().float().reshape(1)
    tensors.update(grads(model, "grad."))

    # CE + coef * aux.
    out_a, rec_a = run(model, inputs, output_router_logits=True)
    if not torch.equal(out_a.logits, logits):
        sys.exit(f"{case}: output_router_logits changed the logits")
    router_logits = out_a.router_logits
    if len(router_logits) != len(moe_layers):
        sys.exit(f"{case}: {len(router_logits)} router logits for MoE layers {moe_layers}")
    for z, layer in zip(router_logits, moe_layers):
        if not torch.equal(z, rec_a[layer][1]):
            sys.exit(f"{case}: outputs.router_logits is not layer {layer}'s router output")
    aux = out_a.aux_loss
    aux_ref = aux_reference(router_logits, E, k)
    if abs(aux_ref.item() - aux.item()) > 1e-6:
        sys.exit(f"{case}: aux formula {aux_ref.item()} != transformers {aux.item()}")
    loss_a = F.cross_entropy(out_a.logits.reshape(-1, V), targets.reshape(-1))
    loss_aux = loss_a + cfg.router_aux_loss_coef * aux
    loss_aux.backward()
    tensors["aux_loss"] = aux.detach().float().reshape(1)
    tensors["loss_aux"] = loss_aux.detach().float().reshape(1)
    tensors.update(grads(model, "grad_aux."))
    changed = [n for n, p in model.named_parameters()
               if not torch.equal(tensors["grad." + n], tensors["grad_aux." + n])]
    for layer in moe_layers:
        n = f"model.layers.{layer}.mlp.gate.weight"
        if n not in changed:
            sys.exit(f"{case}: the aux loss leaves {n}'s gradient unchanged")

    min_margin, min_inner = {}, {}
    for layer in moe_layers:
        _, z, idx = rec[layer]
        m = margins(z, k)
        min_margin[layer] = m.min().item()
        min_inner[layer] = inner_gap(z, k)
        tensors[f"routing.{layer}"] = idx.to(torch.int32).contiguous()
        tensors[f"router_margin.{layer}"] = m.float().contiguous()

    # Small batch: some experts idle, their gradients exactly zero.
    out_s, rec_s = run(model, s_inputs)
    loss_s = F.cross_entropy(out_s.logits.reshape(-1, V), s_targets.reshape(-1))
    loss_s.backward()
    tensors["small.inputs"] = s_inputs.to(torch.int32)
    tensors["small.targets"] = s_targets.to(torch.int32)
    tensors["small.logits"] = out_s.logits.detach().float().contiguous()
    tensors["small.loss"] = loss_s.detach().float().reshape(1)
    small_grads = grads(model, "small.grad.")
    tensors.update(small_grads)
    idle = {}
    for layer in moe_layers:
        idx = rec_s[layer][2]
        tensors[f"small.routing.{layer}"] = idx.to(torch.int32).contiguous()
        idle[layer] = sorted(set(range(E)) - set(idx.reshape(-1).tolist()))
        if not idle[layer]:
            sys.exit(f"{case}: every expert of layer {layer} gets a small-batch token")
        gu = small_grads[f"small.grad.model.layers.{layer}.mlp.experts.gate_up_proj"]
        dn = small_grads[f"small.grad.model.layers.{layer}.mlp.experts.down_proj"]
        for e in range(E):
            zero = not gu[e].any() and not dn[e].any()
            if zero != (e in idle[layer]):
                sys.exit(f"{case}: layer {layer} expert {e}: gradient zero={zero}, "
                         f"idle={e in idle[layer]}")

    # bf16: transformers' own model cast to bfloat16, same batch.
    out_bf, rec_bf = got["out_bf"], got["rec_bf"]
    bf_logits = out_bf.logits.float()
    tensors["bf16.logits"] = bf_logits.contiguous()
    bf_loss = F.cross_entropy(bf_logits.reshape(-1, V), targets.reshape(-1))
    tensors["bf16.loss"] = bf_loss.reshape(1)
    same_order = True
    for layer in moe_layers:
        idx_bf = rec_bf[layer][2]
        tensors[f"bf16.routing.{layer}"] = idx_bf.to(torch.int32).contiguous()
        assert torch.equal(idx_bf.sort(-1).values, rec[layer][2].sort(-1).values)
        same_order &= torch.equal(idx_bf, rec[layer][2])
    # load_balancing_loss_func takes its softmax in the logits' dtype (bf16
    # here) and its own topk on that, not the router's FP32 one.
    aux_bf_ref = aux_reference([z.float() for z in out_bf.router_logits], E, k)

    case_dir = os.path.join(out_dir, case)
    os.makedirs(case_dir, exist_ok=True)
    model.save_pretrained(case_dir, save_original_format=False)
    gen_cfg = os.path.join(case_dir, "generation_config.json")
    if os.path.exists(gen_cfg):
        os.remove(gen_cfg)
    with safe_open(os.path.join(case_dir, "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    names = {n for n, _ in model.named_parameters()}
    if saved != names:
        sys.exit(f"{case}: model.safetensors names differ: {sorted(saved ^ names)}")
    for layer in moe_layers:
        for n in ("gate_up_proj", "down_proj"):
            if f"model.layers.{layer}.mlp.experts.{n}" not in saved:
                sys.exit(f"{case}: no 3-D model.layers.{layer}.mlp.experts.{n}")

    save_file(tensors, os.path.join(case_dir, "fixture.safetensors"), metadata={"case": case})

    # Self-check: what was saved loads back to the same function.
    back = AutoModelForCausalLM.from_pretrained(case_dir, attn_implementation="eager",
                                                experts_implementation="eager",
                                                dtype=torch.float32)
    assert back.config._experts_implementation == "eager"
    # from_pretrained leaves the weights in the memory-mapped file, 8 bytes
    # past a 64-byte boundary; the CPU GEMM then rounds some sums differently
    # (logits differ by ~2e-7). Copies into fresh (aligned) memory give the
    # same bits as the model that was saved.
    with torch.no_grad():
        for p in back.parameters():
            p.data = p.data.clone()
    with torch.no_grad():
        again = back(input_ids=inputs, use_cache=False).logits
    if not torch.equal(again, logits.detach()):
        err = (again - logits).abs().max().item()
        sys.exit(f"{case}: reloaded model gives different logits (max abs err {err})")

    nparams = sum(p.numel() for p in model.parameters())
    print(f"{case}: seed={used_seed} (attempt {attempt}) params={nparams} loss={loss.item():.6f} "
          f"aux={aux.item():.6f} (formula {aux_ref.item():.6f}) loss_aux={loss_aux.item():.6f} "
          f"small.loss={loss_s.item():.6f} bf16.loss={tensors['bf16.loss'].item():.6f} "
          f"reload=identical")
    print("  router fit (tokens corrected, |dW|/|W|): "
          + ", ".join(f"layer {l}: {n}/{B * T}, {r:.3f}" for l, (n, r) in got["fit"].items()))
    print(f"  moe layers {moe_layers}; min router margin "
          + ", ".join(f"layer {l}: {m:.8f}" for l, m in min_margin.items())
          + "; min gap inside the top k "
          + ", ".join(f"layer {l}: {m:.2e}" for l, m in min_inner.items())
          + f"; small batch idle experts {idle}")
    print(f"  bf16 routing: same sets, same order={same_order}; "
          f"bf16 aux={out_bf.aux_loss.item():.6f} "
          f"(formula on its bf16 logits in float64: {aux_bf_ref.item():.6f}); "
          f"grad_aux differs from grad for {len(changed)}/{len(names)} parameters")


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(root, "tests", "fixtures", "moe")
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)  # one thread: reductions sum in a fixed order
    for case, extra, seed in CASES:
        make_case(out_dir, case, extra, seed)


if __name__ == "__main__":
    main()
