package checkpoint

// Sample is the data testdata/v1.json was written from, for external tests.
var Sample = sample
