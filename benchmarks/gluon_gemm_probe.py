"""Probe: a persistent, warp-specialised (ping-pong) Hopper GEMM in Gluon against cuBLAS.

    python -m benchmarks.gluon_gemm_probe --compile   # compile for sm_90 only (no GPU needed)
    python -m benchmarks.gluon_gemm_probe             # correctness, then timings (a Hopper GPU)

Whether a hand-written warp-specialised GEMM can carry epilogues (bias + GELU storing the
pre-activation in forward, the GELU derivative in backward) at cuBLAS's rate, the question
of docs/notes/gemm.md ("Open") and issue 33's SwiGLU section. y = x @ w.T with x [M, K] and
w [N, K] in bf16. Two consumer warpgroups (the default partition and a 4-warp worker) take
alternate output tiles, each with its own accumulator, so that one's epilogue runs under
the other's mainloop; a 1-warp worker issues the TMA loads of every tile, in tile order,
into one ring of stages both consumers read. Not an op: no autograd, no checks, sm_90 and
bf16 only; an op comes only if the timings say it wins.
"""

import argparse
import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# the TMA copies' names changed after Triton 3.6 (the GPU machine's); 3.9 refuses the old ones
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global


@gluon.jit
def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
    """The (row, column) block of a tile, GROUP_M row blocks at a time (L2 reuse of w)."""
    group = GROUP_M * num_pid_n
    first_m = (tile // group) * GROUP_M
    rows = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % group) % rows
    pid_n = (tile % group) // rows
    return pid_m, pid_n


@gluon.jit
def _loader(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, GROUP_M: gl.constexpr):
    """The 1-warp partition: every k-step of every tile of this program, in order, into
    the ring (``ready[slot]`` completes with the bytes; ``empty[slot]`` frees the slot)."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    STAGES: gl.constexpr = a_bufs.shape[0]
    num_pid_m = gl.cdiv(M, BM)
    num_pid_n = gl.cdiv(N, BN)
    k_tiles = gl.cdiv(K, BK)
    count = 0
    for tile in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        for kk in range(k_tiles):
            slot = count % STAGES
            # a slot's first use waits on phase 1: a fresh mbarrier counts as completed once
            mbarrier.wait(empty.index(slot), ((count // STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            _tma_load(a_desc, [pid_m * BM, kk * BK], bar, a_bufs.index(slot))
            _tma_load(b_desc, [pid_n * BN, kk * BK], bar, b_bufs.index(slot))
            count += 1


@gluon.jit
def _consumer(
    a_desc,
    b_desc,
    c_desc,
    p_desc,
    bias_ptr,
    a_bufs,
    b_bufs,
    ready,
    empty,
    turn,
    c_smem,
    p_smem,
    pbar,
    M,
    N,
    K,
    ME: gl.constexpr,
    GROUP_M: gl.constexpr,
    EPILOGUE: gl.constexpr,
):
    """EPILOGUE 0: c = acc; 1: p = acc + bias, c = gelu_tanh(p); 2: c = acc * gelu_tanh'(p),
    p read (its tile's TMA load issued as the mainloop starts)."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    STAGES: gl.constexpr = a_bufs.shape[0]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    num_pid_m = gl.cdiv(M, BM)
    num_pid_n = gl.cdiv(N, BN)
    k_tiles = gl.cdiv(K, BK)
    first = gl.program_id(0)
    step = gl.num_programs(0)
    num_tiles = num_pid_m * num_pid_n
    mine = 0  # how many of this program's tiles came before: the ring position of a tile
    for tile in range(first, num_tiles, step):
        if mine % 2 == ME:
            pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
            count = mine * k_tiles
            # mainloops take turns (consumer 0 first): a consumer waiting on a slot more
            # than one ring lap ahead of the loads would read a phase parity as done
            mbarrier.wait(turn.index(ME), ((mine // 2) & 1) ^ (1 - ME))
            if EPILOGUE == 2:
                fence_async_shared()  # the last tile's reads of p_smem before the TMA write
                mbarrier.expect(pbar, p_desc.block_type.nbytes)
                _tma_load(p_desc, [pid_m * BM, pid_n * BN], pbar, p_smem)
            acc = gl.zeros((BM, BN), gl.float32, acc_layout)
            for kk in range(k_tiles):
                slot = count % STAGES
                mbarrier.wait(ready.index(slot), (count // STAGES) & 1)
                acc = warpgroup_mma(
                    a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)), acc, use_acc=kk > 0, is_async=True
                )
                acc = warpgroup_mma_wait(1, deps=[acc])
                # the MMA before this one has read its slot: hand that slot back
                mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES), pred=kk > 0)
                count += 1
            mbarrier.arrive(turn.index(1 - ME))
            acc = warpgroup_mma_wait(0, deps=[acc])
            mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES))
            off_m = pid_m * BM
            off_n = pid_n * BN
            if EPILOGUE == 1:
                cols = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, acc_layout))
                bias = gl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(gl.float32)
                pre16 = (acc + bias[None, :]).to(c_desc.dtype)
                x = pre16.to(gl.float32)
                inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
                t = 1.0 - 2.0 / (gl.exp2(inner * 2.8853900817779268) + 1.0)
                out = 0.5 * x * (1.0 + t)
                tma.store_wait(0)
                p_smem.store(pre16)
                c_smem.store(out.to(c_desc.dtype))
                fence_async_shared()
                _tma_store(p_desc, [off_m, off_n], p_smem)
                _tma_store(c_desc, [off_m, off_n], c_smem)
            elif EPILOGUE == 2:
                mbarrier.wait(pbar, (mine // 2) & 1)
                x = p_smem.load(acc_layout).to(gl.float32)
                inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
                t = 1.0 - 2.0 / (gl.exp2(inner * 2.8853900817779268) + 1.0)
                slope = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * x * x)
                tma.store_wait(0)
                c_smem.store((acc * slope).to(c_desc.dtype))
                fence_async_shared()
                _tma_store(c_desc, [off_m, off_n], c_smem)
            else:
                tma.store_wait(0)
                c_smem.store(acc.to(c_desc.dtype))
                fence_async_shared()
                _tma_store(c_desc, [off_m, off_n], c_smem)
        mine += 1
    tma.store_wait(0)


@gluon.jit
def _ws_gemm_kernel(
    a_desc,
    b_desc,
    c_desc,
    p_desc,
    bias_ptr,
    M,
    N,
    K,
    STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
    EPILOGUE: gl.constexpr,
):
    dtype: gl.constexpr = a_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    c_smem0 = gl.allocate_shared_memory(dtype, c_desc.block_type.shape, c_desc.layout)
    c_smem1 = gl.allocate_shared_memory(dtype, c_desc.block_type.shape, c_desc.layout)
    if EPILOGUE != 0:
        p_smem0 = gl.allocate_shared_memory(dtype, p_desc.block_type.shape, p_desc.layout)
        p_smem1 = gl.allocate_shared_memory(dtype, p_desc.block_type.shape, p_desc.layout)
    else:
        p_smem0 = c_smem0
        p_smem1 = c_smem1
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    pbars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
        mbarrier.init(pbars.index(i), count=1)
    gl.warp_specialize(
        [
            (
                _consumer,
                (
                    a_desc,
                    b_desc,
                    c_desc,
                    p_desc,
                    bias_ptr,
                    a_bufs,
                    b_bufs,
                    ready,
                    empty,
                    turn,
                    c_smem0,
                    p_smem0,
                    pbars.index(0),
                    M,
                    N,
                    K,
                    0,
                    GROUP_M,
                    EPILOGUE,
                ),
            ),
            (
                _consumer,
                (
                    a_desc,
                    b_desc,
                    c_desc,
                    p_desc,
                    bias_ptr,
                    a_bufs,
                    b_bufs,
                    ready,
                    empty,
                    turn,
                    c_smem1,
                    p_smem1,
                    pbars.index(1),
                    M,
                    N,
                    K,
                    1,
                    GROUP_M,
                    EPILOGUE,
                ),
            ),
            (_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, GROUP_M)),
        ],
        [4, 1],
        [216, 24],
    )


def ws_gemm(x, w, bias=None, pre=None, BM=128, BN=128, BK=64, STAGES=None, GROUP_M=8):
    """x [M, K] @ w[N, K].T in bf16: plain; with ``bias``, (gelu_tanh(x @ w.T + bias), pre);
    with ``pre``, (x @ w.T) * gelu_tanh'(pre)."""
    M, K = x.shape
    N = w.shape[0]
    mode = 1 if bias is not None else 2 if pre is not None else 0
    if STAGES is None:  # [BM, BN] epilogue buffers leave room for one stage less
        STAGES = 3 if mode else 4
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    if mode == 1:
        pre = torch.empty_like(y)
    a_layout = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16)
    b_layout = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.bfloat16)
    c_layout = gl.NVMMASharedLayout.get_default_for([BM, BN], gl.bfloat16)
    a_desc = TensorDescriptor.from_tensor(x, [BM, BK], a_layout)
    b_desc = TensorDescriptor.from_tensor(w, [BN, BK], b_layout)
    c_desc = TensorDescriptor.from_tensor(y, [BM, BN], c_layout)
    p_desc = TensorDescriptor.from_tensor(pre if mode else y, [BM, BN], c_layout)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    tiles = triton.cdiv(M, BM) * triton.cdiv(N, BN)
    _ws_gemm_kernel[(min(sms, tiles),)](
        a_desc,
        b_desc,
        c_desc,
        p_desc,
        bias if bias is not None else y,
        M,
        N,
        K,
        STAGES,
        GROUP_M,
        mode,
        num_warps=4,
        maxnreg=168,
    )
    return (y, pre) if mode == 1 else y


def compile_for_sm90() -> None:
    """Compile the kernel's three epilogues for sm_90 with ``triton.compile`` and print their
    shared memory (the limit is 227 KiB a program): no GPU is needed."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    def descriptor(block):
        layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
        return f"tensordesc<bf16[{block[0]}, {block[1]}],{layout!r}>"

    signature = {
        "a_desc": descriptor([128, 64]),
        "b_desc": descriptor([128, 64]),
        "c_desc": descriptor([128, 128]),
        "p_desc": descriptor([128, 128]),
        "bias_ptr": "*bf16",
        "M": "i32",
        "N": "i32",
        "K": "i32",
        "STAGES": "constexpr",
        "GROUP_M": "constexpr",
        "EPILOGUE": "constexpr",
    }
    for epilogue in (0, 1, 2):
        constexprs = {"STAGES": 3 if epilogue else 4, "GROUP_M": 8, "EPILOGUE": epilogue}
        source = GluonASTSource(_ws_gemm_kernel, signature, constexprs=constexprs)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": 168})
        print(f"epilogue {epilogue}: compiled for sm_90, {compiled.metadata.shared} bytes of shared memory")


def _gelu_tanh_ref(x):
    return torch.nn.functional.gelu(x.float(), approximate="tanh")


def _gelu_tanh_slope_ref(x):
    x = x.float().requires_grad_()
    (slope,) = torch.autograd.grad(_gelu_tanh_ref(x).sum(), x)
    return slope


def _check() -> None:
    """The three epilogues against fp32 references at small, ragged shapes."""
    for M, K, N in [(512, 256, 384), (1000, 320, 520)]:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5
        b = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        ref = x.float() @ w.float().T
        y = ws_gemm(x, w)
        print(f"check {M}x{K}x{N}: plain, max error {(y.float() - ref).abs().max().item():.3g}", flush=True)
        y, pre = ws_gemm(x, w, bias=b)
        pre_error = (pre.float() - (ref + b.float())).abs().max().item()
        gelu_error = (y.float() - _gelu_tanh_ref(pre)).abs().max().item()
        print(f"  bias + gelu: pre {pre_error:.3g}, gelu {gelu_error:.3g}", flush=True)
        y = ws_gemm(x, w, pre=pre)
        expected = ref * _gelu_tanh_slope_ref(pre)
        error = (y.float() - expected).abs().max().item()
        print(f"  dgelu: {error:.3g} (largest |value| {expected.abs().max().item():.3g})", flush=True)


def _time() -> None:
    """GPU times (CUDA graphs) against cuBLAS, and the epilogues against lstrain's present path
    (cuBLAS + ``bias_act_dropout``), at GPT-2 medium's and LLaMA-0.75B's MLP shapes."""
    from triton.testing import do_bench, do_bench_cudagraph

    from lstrain.ops import bias_act_dropout, linear

    for M, K, N in [(8192, 1024, 4096), (8192, 4096, 1024), (8192, 2048, 11264), (8192, 8192, 8192)]:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5
        b = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        flops = 2 * M * N * K
        cublas = do_bench_cudagraph(functools.partial(torch.matmul, x, w.T))
        row = f"{M}x{K}x{N}: cuBLAS {cublas * 1e3:.1f} us ({flops / cublas / 1e9:.0f} TFLOP/s)"
        for config in [{"STAGES": 4}, {"STAGES": 5}, {"STAGES": 4, "GROUP_M": 16}]:
            try:
                ms = do_bench_cudagraph(functools.partial(ws_gemm, x, w, **config))
                row += f"; {config} {ms * 1e3:.1f} us ({flops / ms / 1e9:.0f})"
            except Exception as error:  # noqa: BLE001  (a probe: report and go on)
                row += f"; {config} failed: {type(error).__name__}: {str(error)[:160]}"
        print(row, flush=True)
        if N in (4096, 11264):
            present = do_bench_cudagraph(
                lambda x=x, w=w, b=b: bias_act_dropout(linear(x, w), b, activation="gelu_tanh")
            )
            fused = do_bench_cudagraph(functools.partial(ws_gemm, x, w, bias=b))
            print(f"  forward bias + gelu: fused {fused * 1e3:.1f} us; cuBLAS + bias_act_dropout {present * 1e3:.1f}")
            pre = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            bias = b.clone().requires_grad_()
            out = bias_act_dropout(pre, bias, activation="gelu_tanh")
            dh = torch.randn_like(out)
            # autograd's engine cannot run under a capture on the side stream of do_bench_cudagraph:
            # plain do_bench, whose back-to-back calls keep the GPU ahead of the host
            backward = do_bench(
                lambda out=out, pre=pre, bias=bias, dh=dh: torch.autograd.grad(out, (pre, bias), dh, retain_graph=True)
            )
            fused = do_bench_cudagraph(functools.partial(ws_gemm, x, w, pre=pre.detach()))
            print(
                f"  backward dgelu: fused {fused * 1e3:.1f} us (no bias gradient); cuBLAS {cublas * 1e3:.1f} + "
                f"bias_act_dropout's backward {backward * 1e3:.1f} (with it)",
                flush=True,
            )


def main(argv: list[str] | None = None) -> None:
    """The command line (see the module docstring).

    Args:
        argv: the arguments (default ``sys.argv[1:]``).
    """
    parser = argparse.ArgumentParser(description="Gluon ping-pong GEMM probe against cuBLAS.")
    parser.add_argument("--compile", action="store_true", help="compile for sm_90 only (no GPU needed)")
    args = parser.parse_args(argv)
    if args.compile:
        compile_for_sm90()
        return
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), "triton", triton.__version__, flush=True)
    _check()
    _time()


if __name__ == "__main__":
    main()
