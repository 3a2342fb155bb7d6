import sys, triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
@triton.jit
def att(Q, K, V, O, PT, n_keys, lo, qdesc, kdesc, vdesc, flag, qk_scale, MODE: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    if MODE & 32:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    m = tl.program_id(0) * BM + tl.arange(0, BM); d = tl.arange(0, D)
    q = qdesc.load([tl.program_id(0) * (BM // 4), 0, 0]).reshape(BM, D)
    if MODE & 8:
        kd = kdesc
        vd = vdesc
    else:
        kd = tl.make_tensor_descriptor(K, [n_keys, 1024], [1024, 1], [BN, D])
        vd = tl.make_tensor_descriptor(V, [n_keys, 1024], [1024, 1], [BN, D])
    acc = tl.zeros((BM, D), tl.float32)
    m_i = tl.full((BM,), float("-inf"), tl.float32)
    l_i = tl.zeros((BM,), tl.float32)
    for s in tl.range(lo, n_keys, BN, warp_specialize=True):
        page = tl.load(PT + s // 64).to(tl.int64)
        page = tl.minimum(tl.maximum(page, 0), 1000)
        row = (page * 64 + s % 64).to(tl.int32)
        k = kd.load([row, 128])
        qk = tl.dot(q, tl.trans(k))
        if MODE & 64:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.exp2(qk * qk_scale - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.exp2(qk - m_new[:, None])
            acc = acc * tl.exp2(m_i - m_new)[:, None]
        acc = tl.dot(p.to(tl.bfloat16), vd.load([row, 128]), acc)
        m_i = m_new
    if MODE & 16:
        if flag > 0:
            kt = tl.load(K + m[:, None] * D + d[None, :])
            s2 = tl.dot(q, tl.trans(kt))
            acc = tl.dot(s2.to(tl.bfloat16), kt, acc)
    tl.store(O + m[:, None] * D + d[None, :], (acc / (l_i[:, None] + 1)).to(tl.bfloat16))
mode = int(sys.argv[1])
src = ASTSource(fn=att, signature=dict(Q="*bf16", K="*bf16", V="*bf16", O="*bf16", PT="*i32", n_keys="i32", lo="i32", qdesc="tensordesc<bf16[16,4,128]>", kdesc="tensordesc<bf16[64,128]>", vdesc="tensordesc<bf16[64,128]>", flag="i32", qk_scale="fp32", MODE="constexpr", D="constexpr", BM="constexpr", BN="constexpr"),
    constexprs=dict(MODE=mode, D=128, BM=64, BN=64), attrs={(i,): [["tt.divisibility", 16]] for i in range(5)})
try:
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=3))
    print("mode", mode, "ok; setmaxnreg:", k.asm["ptx"].count("setmaxnreg"), "ws:", "ttg.warp_specialize" in k.asm["ttgir"])
except Exception as e:
    print("mode", mode, "FAILED", str(e)[:100])
