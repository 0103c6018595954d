// Package bench holds the benchmarks that need a real control plane: the
// kubelet plugin's prepare latency against its floor, its throughput at 1 and
// 16 concurrent callers, and its publish time and memory. Every figure is
// reported with b.ReportMetric and compared within one run (ratios), never
// asserted: `make bench` turns them into _output/bench.json
// (test/cmd/benchreport).
package bench
