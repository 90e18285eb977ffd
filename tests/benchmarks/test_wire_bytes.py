"""`python -m benchmarks.wire_bytes`: bytes on the bus per image, from the real message encoder."""

from benchmarks.wire_bytes import decode_bytes, main, step_bytes


def test_bytes_follow_the_tensor_size_and_wire_dtype():
    rgb, latent = step_bytes((3, 32, 32), 64), step_bytes((4, 16, 16), 64)
    assert 2 * 3 * 32 * 32 * 4 < rgb < 1.05 * 2 * 3 * 32 * 32 * 4  # x_t and velocity, float32, little overhead
    assert 2.9 < rgb / latent < 3.1  # 3,072 values against 1,024
    assert 1.9 < step_bytes((3, 32, 32), 64) / step_bytes((3, 32, 32), 64, "float16") < 2.05
    assert 4 * 16 * 16 * 4 + 3 * 32 * 32 * 4 < decode_bytes((4, 16, 16), (3, 32, 32), 64) < 17_000


def test_cli_prints_one_row_per_shape(capsys):
    assert main(["--shape", "3x32x32", "--shape", "latent:4x16x16", "--steps", "10"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 3x") or "latent" in line]
    assert len(rows) == 2 and rows[0].endswith("| - |") and not rows[1].endswith("| - |")
