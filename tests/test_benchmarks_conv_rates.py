"""``python -m benchmarks.conv_rates``: every way of running a conv compiles on this jaxlib (the
oneDNN and YNNPACK options included) and the table has a positive rate in every column."""
import pytest

pytest.importorskip("torch")


def test_conv_rates_table(capsys):
    from benchmarks import conv_rates

    conv_rates.main(["--runs", "1", "--shapes", "1x4x8,2x3x16"])
    lines = capsys.readouterr().out.strip().splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header[1:] == [*conv_rates.CONV_OPTIONS, *conv_rates.DOT_OPTIONS, "torch conv2d", "torch matmul"]
    rows = lines[2:]
    assert [r.split("|")[1].strip() for r in rows] == ["1 x 4 x 4, 8", "2 x 3 x 3, 16"]
    for r in rows:
        rates = [float(c) for c in r.strip("|").split("|")[1:]]
        assert len(rates) == len(header) - 1 and all(v > 0 for v in rates)


def test_conv_rates_oneDNN_dots_are_oneDNN():
    """The oneDNN column measures oneDNN: its options turn the program's dot into a oneDNN fusion."""
    import jax
    import jax.numpy as jnp

    from benchmarks import conv_rates

    a = jnp.ones((8, 16))
    text = jax.jit(lambda x: x @ x.T).lower(a).compile(compiler_options=conv_rates.DOT_OPTIONS["patches: oneDNN"]).as_text()
    assert "onednn_fusion" in text


@pytest.mark.parametrize("shapes", ["4x32", "4x32x0", "4xaxb", "4x32x128,"])
def test_conv_rates_refuses_a_bad_shape_in_one_line(capsys, shapes):
    from benchmarks import conv_rates

    with pytest.raises(SystemExit) as e:
        conv_rates.main(["--shapes", shapes])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--shapes" in err and "FRAMESxPXxCHANNELS" in err and "Traceback" not in err


@pytest.mark.parametrize("runs", ["0", "-1", "x"])
def test_conv_rates_refuses_a_bad_run_count_in_one_line(capsys, runs):
    from benchmarks import conv_rates

    with pytest.raises(SystemExit) as e:
        conv_rates.main(["--runs", runs])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--runs" in err and "positive integer" in err and "Traceback" not in err
