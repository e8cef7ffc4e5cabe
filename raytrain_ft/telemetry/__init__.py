"""What a run records: the `Recorder` interface and its MLflow implementation (`recorder`,
`tracking`), the per-step timeline (`timeline`), step metrics, goodput, an attempt's start record
(`attempt`) and the loss plot. A sink the loop writes to, never reads to decide."""
