import sys, torch, traceback
from common import *
name, backend = sys.argv[1], sys.argv[2]
ms = members(name, 2)
wide = fuse(ms, share_identical=False); wide.train(); wide.compile(backend=backend)
for m in ms: m.train()
# no dropout differences: set all dropout p to 0
for mod in [wide, *ms]:
    for sub in mod.modules():
        if isinstance(sub, torch.nn.Dropout): sub.p = 0.0
for cfg in [m.config for m in ms]:
    pass
opt_w = torch.optim.SGD(wide.parameters(), lr=0.1)
opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in ms]
g = torch.Generator().manual_seed(0)
for step, (b, L) in enumerate([(2, 6), (3, 8), (2, 5)]):
    ids = torch.randint(5, V, (b, L), generator=g)
    mask = torch.ones_like(ids)
    if name == "bert-cls":
        kw = dict(input_ids=ids, attention_mask=mask, labels=torch.randint(0, 3, (b,), generator=g))
    elif name == "t5":
        kw = dict(input_ids=ids, attention_mask=mask, labels=torch.randint(5, V, (b, L - 2), generator=g))
    else:
        kw = dict(input_ids=ids, attention_mask=mask, labels=ids)
    try:
        out = wide(**kw)
        out.loss.sum().backward(); opt_w.step(); opt_w.zero_grad()
        losses = []
        for m, o in zip(ms, opts):
            l = m(**kw).loss; l.backward(); o.step(); o.zero_grad(); losses.append(l.detach())
        ref = torch.stack(losses)
        # after the step compare weights: rebuild members from wide
        wd = max(diff(p, q) for i, m in enumerate(ms) for p, q in zip(wide.member(i).parameters(), m.parameters()))
        print(name, backend, step, (b, L), "loss diff", diff(out.loss.detach(), ref), "loss", out.loss.tolist(), "param diff after step", wd, flush=True)
    except Exception as ex:
        print(name, backend, step, "ERROR", type(ex).__name__, str(ex)[:800], flush=True); traceback.print_exc(limit=-4); break
# final eval forward compiled vs members
wide.eval(); [m.eval() for m in ms]
with torch.no_grad():
    out = wide(**{k: v for k, v in kw.items() if k != "labels"}, **({"decoder_input_ids": kw["labels"]} if name == "t5" else {}))
    refs = [m(**{k: v for k, v in kw.items() if k != "labels"}, **({"decoder_input_ids": kw["labels"]} if name == "t5" else {})) for m in ms]
    print("eval after training, logits diff", max(diff(out.logits[i], r.logits) for i, r in enumerate(refs)))
