"""kernels/compile_check.specialise without triton (mutation review, s59): a launch specialised as triton's JIT does."""
import torch


def test_specialise_follows_tritons_jit_rules():
    """kernels.compile_check.specialise specialises a launch as triton's JIT does: a tensor is a
    pointer with the 16-divisibility hint, an int equal to 1 a constexpr, an int divisible by 16
    an i32 with the hint, any other int a plain i32, a float fp32 (1.0 too). Pure Python, so it
    runs where triton is absent (the compile tests skip there); ``fn`` is a stand-in with the
    one attribute specialise reads (``arg_names``) since a real @triton.jit needs triton."""
    from types import SimpleNamespace

    from kernels.compile_check import specialise

    fn = SimpleNamespace(arg_names=["q", "out", "one", "stride", "n", "scale", "unit", "BLOCK"])
    meta = torch.device("meta")
    args = (torch.empty(2, 8, dtype=torch.bfloat16, device=meta), torch.empty(2, dtype=torch.float32, device=meta),
            1, 32, 24, 0.125, 1.0)
    sig, consts, attrs = specialise(fn, args, {"BLOCK": 64})
    assert sig == {"q": "*bf16", "out": "*fp32", "one": "constexpr", "stride": "i32", "n": "i32",
                   "scale": "fp32", "unit": "fp32", "BLOCK": "constexpr"}
    assert consts == {"BLOCK": 64, "one": 1}
    assert attrs == {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]],
                     (3,): [["tt.divisibility", 16]]}
