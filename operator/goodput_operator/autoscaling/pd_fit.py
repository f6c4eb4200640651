"""The step-time fit of bench/pd_profile.json, for goodput_operator.autoscaling.split. Written by
python -m bench.pd_profile; do not edit."""

PROFILE = {
    "fit": {
        "prefill": {"a": 0.10414480511707208, "b": 0.0015701966197486919, "c": 4.6095308243317976e-07},
        "decode": {"d0": 0.06902168102051823, "d1": 0.003379622415803694, "d2": 6.696339112563168e-06},
        "mixed": {"m": 1.0451826668279933},
        "handoff": {"h0": 0.0, "bytes_per_second": 123243501.57303937},
    },
    "bytes_per_token": 46080,
    "machine": "2 shared CPU cores (Intel(R) Xeon(R) Processor), no GPU, Linux 6.18.44-fc-v769, torch CPU, 1 threads",
}
