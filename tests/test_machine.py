"""Benchmarks name the CPU they ran on precisely enough to tell its generations apart."""

from benchmarks.machine import cpu_name


def test_cpu_name_carries_family_and_model_numbers():
    info = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 23\nmodel\t\t: 1\nmodel name\t: AMD EPYC\n" \
           "processor\t: 1\ncpu family\t: 23\nmodel\t\t: 1\nmodel name\t: AMD EPYC\n"
    assert cpu_name(info) == "AMD EPYC (family 23, model 1)"
    assert cpu_name("model name\t: Intel(R) Xeon(R) Processor\n") == "Intel(R) Xeon(R) Processor"
