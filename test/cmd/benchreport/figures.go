package main

import (
	"fmt"
	"slices"
)

// figure is one key of the report: which benchmark reports it, under which
// b.ReportMetric unit, and the goal for it, if any.
type figure struct {
	Key       string
	Benchmark string // without the -GOMAXPROCS suffix
	Metric    string // the unit passed to b.ReportMetric
	Unit      string // the unit written to the report
	Goal      *goal
}

// goal is a bound a figure should meet: Op is "<", "<=" or ">=".
// MinSamples, when set, is how many samples the figure must summarise (its
// benchmark reports the count as <metric>-n) for the goal to be judged: a
// figure from fewer fails as one that missed its goal. Short puts the
// figure in the short subset CI runs (make bench-short, benchreport -short).
type goal struct {
	Op         string
	Value      float64
	MinSamples int
	Short      bool
}

func (g goal) String() string {
	if g.MinSamples > 0 {
		return fmt.Sprintf("%s %g (n >= %d)", g.Op, g.Value, g.MinSamples)
	}
	return fmt.Sprintf("%s %g", g.Op, g.Value)
}

func (g goal) met(v float64) bool {
	switch g.Op {
	case "<":
		return v < g.Value
	case "<=":
		return v <= g.Value
	default:
		return v >= g.Value
	}
}

func bound(op string, v float64) *goal { return &goal{Op: op, Value: v} }

// samples requires the figure to summarise at least n samples.
func (g *goal) samples(n int) *goal { g.MinSamples = n; return g }

// short puts the figure in the short subset CI runs.
func (g *goal) short() *goal { g.Short = true; return g }

// figures are the report's keys, in the order of the table.
var figures = []figure{
	{"prepare_p50_ms", "BenchmarkPrepare", "ms/p50", "ms", nil},
	{"prepare_p99_ms", "BenchmarkPrepare", "ms/p99", "ms", nil},
	{"prepare_floor_p50_ms", "BenchmarkPrepare", "ms/floor-p50", "ms", nil},
	{"prepare_vs_floor", "BenchmarkPrepare", "x/floor", "ratio", bound("<=", 2).samples(600).short()},
	{"prepare_p50_ms_rolling", "BenchmarkPrepare", "ms/p50-rolling", "ms", nil},
	{"prepare_p99_ms_rolling", "BenchmarkPrepare", "ms/p99-rolling", "ms", nil},
	{"prepare_vs_floor_rolling", "BenchmarkPrepare", "x/floor-rolling", "ratio", bound("<=", 2).samples(600)},
	{"prepare_claims_per_s_c1", "BenchmarkPrepareThroughput", "claims/s-c1", "claims/s", nil},
	{"prepare_claims_per_s_c16", "BenchmarkPrepareThroughput", "claims/s-c16", "claims/s", nil},
	{"prepare_concurrency_speedup", "BenchmarkPrepareThroughput", "speedup", "ratio", bound(">=", 8)},
	{"prepare_claims_per_s_c1_rolling", "BenchmarkPrepareThroughput", "claims/s-c1-rolling", "claims/s", nil},
	{"prepare_claims_per_s_c16_rolling", "BenchmarkPrepareThroughput", "claims/s-c16-rolling", "claims/s", nil},
	{"prepare_concurrency_speedup_rolling", "BenchmarkPrepareThroughput", "speedup-rolling", "ratio", bound(">=", 8)},
	{"prepare_cpu_busy_c1", "BenchmarkPrepareThroughput", "cpu-busy-c1", "share of all CPUs", nil},
	{"prepare_cpu_busy_c16", "BenchmarkPrepareThroughput", "cpu-busy-c16", "share of all CPUs", nil},
	{"prepare_cpu_ms_per_claim_c16", "BenchmarkPrepareThroughput", "cpu-ms/claim-c16", "ms", nil},
	{"prepare_plugin_cpu_ms_per_claim_c16", "BenchmarkPrepareThroughput", "plugin-cpu-ms/claim-c16", "ms", nil},
	{"prepare_checkpoint_writes_per_claim_c1", "BenchmarkPrepareThroughput", "checkpoint-writes/claim-c1", "writes", nil},
	{"prepare_checkpoint_writes_per_claim_c16", "BenchmarkPrepareThroughput", "checkpoint-writes/claim-c16", "writes", nil},
	{"prepare_checkpoint_writes_per_claim_c1_rolling", "BenchmarkPrepareThroughput", "checkpoint-writes/claim-c1-rolling", "writes", nil},
	{"prepare_checkpoint_writes_per_claim_c16_rolling", "BenchmarkPrepareThroughput", "checkpoint-writes/claim-c16-rolling", "writes", nil},
	{"prepare_checkpoint_busy_c1", "BenchmarkPrepareThroughput", "checkpoint-busy-c1", "share of the time", nil},
	{"prepare_checkpoint_busy_c16", "BenchmarkPrepareThroughput", "checkpoint-busy-c16", "share of the time", nil},
	{"prepare_slice_writes_per_claim", "BenchmarkPrepareThroughput", "slice-writes/claim", "writes", nil},
	{"prepare_slice_writes_per_claim_rolling", "BenchmarkPrepareThroughput", "slice-writes/claim-rolling", "writes", nil},
	{"prepare_claims_per_s_c16_nolazy", "BenchmarkPrepareThroughput", "claims/s-c16-nolazy", "claims/s", nil},
	{"prepare_plugin_cpu_ms_per_claim_c16_nolazy", "BenchmarkPrepareThroughput", "plugin-cpu-ms/claim-c16-nolazy", "ms", nil},
	{"prepare_c16_vs_nolazy", "BenchmarkPrepareThroughput", "x/nolazy-c16", "ratio", nil},
	{"prepare_plugin_cpu_vs_nolazy_c16", "BenchmarkPrepareThroughput", "cpu-x/nolazy-c16", "ratio", bound("<=", 1.5)},
	{"prepare_shipped_vs_nodynamic_c1", "BenchmarkPrepareByConfiguration", "x/nodynamic-c1", "ratio", nil},
	{"prepare_shipped_vs_nodynamic_c8", "BenchmarkPrepareByConfiguration", "x/nodynamic-c8", "ratio", bound(">=", 0.8)},
	{"prepare_plugin_cpu_shipped_vs_nodynamic_c8", "BenchmarkPrepareByConfiguration", "cpu-x/nodynamic-c8", "ratio", bound("<=", 1.5)},
	{"allocator_us_per_claim_plain", "BenchmarkAllocatorMIGVsPlain", "us/plain-claim", "us", nil},
	{"allocator_us_per_claim_mig", "BenchmarkAllocatorMIGVsPlain", "us/mig-claim", "us", nil},
	{"allocator_mig_vs_plain", "BenchmarkAllocatorMIGVsPlain", "plain/mig", "ratio", bound(">=", 0.3)},
	{"allocator_us_per_claim_500_nodes", "BenchmarkAllocator500Nodes", "us/claim", "us", nil},
	{"publish_ms", "BenchmarkPublish", "ms/publish", "ms", bound("<", 500).samples(9)},
	{"publish_registered_ms", "BenchmarkPublish", "ms/registered", "ms", nil},
	{"publish_after_registration_ms", "BenchmarkPublish", "ms/publish-after-registration", "ms", nil},
	{"publish_floor_ms", "BenchmarkPublish", "ms/publish-floor", "ms", nil},
	{"publish_vs_floor", "BenchmarkPublish", "x/publish-floor", "ratio", bound("<=", 5).samples(9).short()},
	{"plugin_rss_mib", "BenchmarkPublish", "MiB/rss", "MiB", bound("<", 50).samples(9).short()},
	{"plugin_rss_anon_mib", "BenchmarkPublish", "MiB/rss-anon", "MiB", nil},
	{"plugin_rss_file_mib", "BenchmarkPublish", "MiB/rss-file", "MiB", nil},
	{"gang_64_s", "BenchmarkGangPlacement/pods=64", "gang_64_s", "s", nil},
	{"gang_128_s", "BenchmarkGangPlacement/pods=128", "gang_128_s", "s", nil},
	{"gang_256_s", "BenchmarkGangPlacement/pods=256", "gang_256_s", "s", bound("<", 10)},
	{"gang_512_s", "BenchmarkGangPlacement/pods=512", "gang_512_s", "s", nil},
	// Each gang over its floor on the same cluster: as many one-GPU pods
	// without a gang, creation to bound. The gang's time moves with the
	// machine's load (5 s quiet, 15-31 s on a busy two-core machine), the
	// ratio far less: it is what CI judges.
	{"plain_256_s", "BenchmarkGangPlacement/pods=256", "plain_256_s", "s", nil},
	{"gang_64_vs_plain", "BenchmarkGangPlacement/pods=64", "gang_64_vs_plain", "ratio", nil},
	{"gang_128_vs_plain", "BenchmarkGangPlacement/pods=128", "gang_128_vs_plain", "ratio", nil},
	{"gang_256_vs_plain", "BenchmarkGangPlacement/pods=256", "gang_256_vs_plain", "ratio", bound("<=", 3).samples(3).short()},
	{"gang_512_vs_plain", "BenchmarkGangPlacement/pods=512", "gang_512_vs_plain", "ratio", nil},
	{"gang_wait_vs_earliest_reserved", "BenchmarkGangScheduling/reserved", "gang_wait_vs_earliest_reserved", "ratio", bound("<=", 1.2).samples(3)},
	{"gang_wait_vs_earliest_unreserved", "BenchmarkGangScheduling/unreserved", "gang_wait_vs_earliest_unreserved", "ratio", nil},
	{"gpu_utilization_backfill", "BenchmarkGangScheduling/reserved", "gpu_utilization_backfill", "share of the GPUs", nil},
	{"gpu_utilization_unreserved", "BenchmarkGangScheduling/unreserved", "gpu_utilization_unreserved", "share of the GPUs", nil},
	{"gpu_utilization_backfill_vs_unreserved", "BenchmarkGangScheduling/compare", "gpu_utilization_backfill_vs_unreserved", "ratio", bound(">=", 0.9).samples(3)},
}

// schedCases and schedNodes are BenchmarkSchedulerThroughput's cases and the
// node counts make bench runs; whole is the case the others are compared to.
var (
	// lazy1g and lazywhole are dynamic MIG as shipped (LazyMIG on); mig1g
	// and migwhole with every partition published (LazyMIG off).
	schedCases = []string{"whole", "mig1g", "migwhole", "lazy1g", "lazywhole", "timeslice", "memshare"}
	// schedLevers are layouts the plugin does not publish, measured beside
	// the cases: their ratios are figures, not goals.
	schedLevers = []string{"aligned1g", "alignedwhole"}
	schedNodes  = []int{100, 500}
)

func init() { figures = append(figures, slices.Concat(configFigures(), schedFigures())...) }

// configurations are BenchmarkPrepareByConfiguration's figure suffixes: the
// shipped gates, LazyMIG off, DynamicMIG off.
var configurations = []string{"shipped", "nolazy", "nodynamic"}

// configFigures are BenchmarkPrepareByConfiguration's per-configuration keys.
func configFigures() []figure {
	const bench = "BenchmarkPrepareByConfiguration"
	var out []figure
	for _, c := range configurations {
		out = append(out,
			figure{"prepare_claims_per_s_c1_" + c, bench, "claims/s-c1-" + c, "claims/s", nil},
			figure{"prepare_claims_per_s_c8_" + c, bench, "claims/s-c8-" + c, "claims/s", nil},
			figure{"prepare_plugin_cpu_ms_per_claim_c1_" + c, bench, "plugin-cpu-ms/claim-c1-" + c, "ms", nil},
			figure{"prepare_plugin_cpu_ms_per_claim_c8_" + c, bench, "plugin-cpu-ms/claim-c8-" + c, "ms", nil},
			figure{"prepare_slice_writes_per_claim_" + c, bench, "slice-writes/claim-" + c, "writes", nil},
		)
	}
	return out
}

// schedFigures are BenchmarkSchedulerThroughput's keys: per node count and
// case, pods/s, scheduler CPU per pod, p50 and p99 of creation to binding,
// and each case's pods/s over the whole case's, measured in the same run
// (goal: at least half).
func schedFigures() []figure {
	var out []figure
	for _, nodes := range schedNodes {
		for _, c := range slices.Concat(schedCases, schedLevers) {
			bench := fmt.Sprintf("BenchmarkSchedulerThroughput/nodes=%d/case=%s", nodes, c)
			key := func(f string) string { return fmt.Sprintf(f, c, nodes) }
			out = append(out,
				figure{key("sched_pods_per_s_%s_%d"), bench, "pods/s", "pods/s", nil},
				figure{key("sched_cpu_ms_per_pod_%s_%d"), bench, "cpu-ms/pod", "ms", nil},
				figure{key("sched_p50_ms_%s_%d"), bench, "ms/p50", "ms", nil},
				figure{key("sched_p99_ms_%s_%d"), bench, "ms/p99", "ms", nil},
			)
			switch {
			case slices.Contains(schedLevers, c):
				out = append(out, figure{key("sched_%s_vs_whole_%d"), bench, "x/whole", "ratio", nil})
			case c != "whole":
				out = append(out, figure{key("sched_%s_vs_whole_%d"), bench, "x/whole", "ratio", bound(">=", 0.5)})
			}
		}
	}
	return out
}
