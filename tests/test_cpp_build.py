"""The C++ extensions' build cache is per instruction set (workers/generation/cpp_build.py):
a build made with -march=native on one kind of CPU must never be loaded on another."""
import pytest

from workers.generation import cpp_build


def _cpuinfo(tmp_path, name, flags):
    p = tmp_path / name
    p.write_text(f"processor\t: 0\nmodel name\t: X\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: ignored\n")
    return str(p)


def test_tag_follows_the_instruction_sets_not_their_order(tmp_path):
    avx2 = cpp_build.cpu_flags(_cpuinfo(tmp_path, "a", "fpu sse avx avx2 fma"))
    avx2_again = cpp_build.cpu_flags(_cpuinfo(tmp_path, "b", "avx2 fma fpu avx sse"))
    avx512 = cpp_build.cpu_flags(_cpuinfo(tmp_path, "c", "fpu sse avx avx2 fma avx512f avx512bw"))
    assert avx2 == "avx avx2 fma fpu sse"
    assert cpp_build.isa_tag(avx2) == cpp_build.isa_tag(avx2_again)
    assert cpp_build.isa_tag(avx2) != cpp_build.isa_tag(avx512)
    assert len(cpp_build.isa_tag(avx2)) == 8


def test_arm_features_line_and_no_cpuinfo(tmp_path):
    p = tmp_path / "arm"
    p.write_text("processor\t: 0\nFeatures\t: fp asimd sve\n")
    assert cpp_build.cpu_flags(str(p)) == "asimd fp sve"
    assert cpp_build.cpu_flags(str(tmp_path / "missing"))  # machine / processor names instead


def test_build_caches_under_the_name_plus_this_cpus_tag(monkeypatch):
    seen = {}

    def fake_load_inline(**kw):  # records the call: compiling is not what this test checks
        seen.update(kw)
        return "module"

    monkeypatch.setattr("torch.utils.cpp_extension.load_inline", fake_load_inline)
    assert cpp_build.build.__wrapped__("ext_v1", "src", ("f",), "test") == "module"
    assert seen["name"] == f"ext_v1_{cpp_build.isa_tag()}"
    assert "-march=native" in seen["extra_cflags"]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_real_extension_is_built_for_this_cpu():
    from workers.generation import cpu_attention

    try:
        mod = cpu_attention.load()
    except RuntimeError as e:  # no compiler here: the engine's clear error, tested elsewhere
        pytest.skip(str(e))
    assert mod.__name__.endswith(cpp_build.isa_tag())
