package slices

// Engine counters as published and before the ones that never bind are left
// out, for the test that proves leaving them out changes nothing.
var (
	EngineLimits = engineLimits
	EngineTotals = engineTotals
	Engines      = engines
)
