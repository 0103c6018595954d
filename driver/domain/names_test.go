package domain

import (
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/util/validation"
)

func TestPoolNamesAreValidAndDistinct(t *testing.T) {
	seen := map[string]string{}
	for _, v := range []string{"7b2f0c5e-1d4a-4e8b-9c3f-0a6d5e4b3c21.1", "rack-1", "Rack_1", "rack_1", "RACK-1", "a..b", "-x-"} {
		for _, kind := range []string{KindNVLink, KindTopology} {
			p := PoolName(kind, v)
			for _, seg := range strings.Split(p, "/") {
				if errs := validation.IsDNS1123Subdomain(seg); len(errs) > 0 {
					t.Errorf("PoolName(%s, %q) = %q: segment %q invalid: %v", kind, v, p, seg, errs)
				}
			}
			if other, dup := seen[p]; dup {
				t.Errorf("PoolName(%s, %q) = %q, same as for %q", kind, v, p, other)
			}
			seen[p] = v
			k, _, ok := ParsePool(p)
			if !ok || k != kind {
				t.Errorf("ParsePool(%q) = %q, %v; want %q", p, k, ok, kind)
			}
		}
	}
	if _, _, ok := ParsePool("node-a"); ok {
		t.Error("a node's pool parsed as a domain pool")
	}
}

func TestDeviceNamesRoundTrip(t *testing.T) {
	for ch := range 3 {
		n, err := ParseDevice(DeviceName(ch))
		if err != nil || n != ch {
			t.Errorf("ParseDevice(DeviceName(%d)) = %d, %v", ch, n, err)
		}
	}
	for _, bad := range []string{"gpu-0", "channel-", "channel--1", "channel-x"} {
		if _, err := ParseDevice(bad); err == nil {
			t.Errorf("ParseDevice(%q) accepted", bad)
		}
	}
}
