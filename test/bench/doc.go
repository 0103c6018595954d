// Package bench holds the benchmarks that need a real control plane: the
// kubelet plugin's prepare latency against its floor, its throughput at 1 and
// 16 concurrent callers, and its publish time (after a kubelet's
// registration) and memory. Every figure is reported with b.ReportMetric,
// compared within one run (ratios) or summarised over several samples
// (medians, with their count and spread), never asserted here: `make bench`
// and `make bench-short` turn them into a report and fail on a missed goal
// (test/cmd/benchreport, which holds the goals).
package bench
