"""Autoscaling on goodput.

- `loop`: the control loop (read → decide → act → record), one per operator process.
- `law`: the pure decision, shared with the simulator in bench/.
- `signals`: from the runtime pods' /metrics text to the law's Signals.
- `sources`: where readings come from (the pods or Prometheus), behind the `Source` protocol.
- `external`: the HPA and ScaledObject of the hpa and keda modes.
"""
