package inventory

import "testing"

// TestProfileLabelsKeepVariantsApart: every variant NVML names (+me, -me,
// +me.all, +gfx) folds to its own label, so device and counter names stay
// distinct (an earlier fold dropped every non-alphanumeric character and
// made 1g.10gb+me and 1g.10gb-me one name).
func TestProfileLabelsKeepVariantsApart(t *testing.T) {
	want := map[string]string{
		"1g.10gb":        "1g10gb",
		"1g.10gb+me":     "1g10gbme",
		"1g.10gb-me":     "1g10gbnome",
		"1g.10gb+me.all": "1g10gbmeall",
		"1g.10gb+gfx":    "1g10gbgfx",
		"2g.20gb":        "2g20gb",
		"2g.20gb-me":     "2g20gbnome",
		"2g.20gb+me.all": "2g20gbmeall",
		"7g.80gb":        "7g80gb",
	}
	seen := map[string]string{}
	for name, label := range want {
		got := ProfileLabel(name)
		if got != label {
			t.Errorf("ProfileLabel(%q) = %q, want %q", name, got, label)
		}
		if other, dup := seen[got]; dup {
			t.Errorf("%q and %q both fold to %q", name, other, got)
		}
		seen[got] = name
	}
}
