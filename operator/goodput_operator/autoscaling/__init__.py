"""Autoscaling on goodput.

- `loop`: the control loop (read → decide → act → record), one per operator process.
- `law`: the pure decision, shared with the simulator in bench/.
- `state`: what the law reads and carries (Policy, Signals, Observation, Memory).
- `arrival`: the arrival rate the law plans for (smoothing, forecast).
- `signals`: from the runtime pods' /metrics text to the law's Signals.
- `sources`: where readings come from (the pods or Prometheus), behind the `Source` protocol.
- `external`: the HPA and ScaledObject of the hpa and keda modes.
"""
