"""One request's journey: extract -> plan -> encode -> match -> rewrite -> prefill -> decode -> relay, run by the pipeline."""
