package ldcache

import (
	"encoding/binary"
	"os"
	"runtime"
	"strings"
	"testing"
)

// crafted is a loader cache of size bytes whose entries all point into one
// long string, each one byte further in: decoded whole, the entries' strings
// add up to the square of the file's size.
func crafted(size int) []byte {
	n := size / (entrySize + 2)
	strStart := headerSize + entrySize*n
	data := make([]byte, size)
	copy(data, magicNew)
	binary.LittleEndian.PutUint32(data[20:], uint32(n))
	data[28] = endianLittle
	for i := range n {
		e := data[headerSize+i*entrySize:]
		binary.LittleEndian.PutUint32(e[0:], FlagX8664Lib64)
		binary.LittleEndian.PutUint32(e[4:], uint32(strStart+i))
		binary.LittleEndian.PutUint32(e[8:], uint32(strStart+i))
	}
	for i := strStart; i < size-1; i++ {
		data[i] = 'a'
	}
	return data
}

// allocated is what f allocates, in bytes (what the whole process
// allocates meanwhile: a fuzz worker or a test does little else).
func allocated(f func()) uint64 {
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	f()
	runtime.ReadMemStats(&after)
	return after.TotalAlloc - before.TotalAlloc
}

// memoryBound is what Parse may allocate for a file of n bytes: linear in
// its size.
func memoryBound(n int) uint64 { return uint64(16*n + 1<<20) }

// TestACraftedCacheCostsMemoryLinearInItsSize: a 293 KiB cache whose entries
// all point into one long string (about 1.5 GiB decoded whole) is refused,
// naming why, having allocated memory linear in its size; the host's own
// cache still parses within the same bound.
func TestACraftedCacheCostsMemoryLinearInItsSize(t *testing.T) {
	data := crafted(293 << 10)
	var err error
	if got := allocated(func() { _, err = Parse(data) }); got > memoryBound(len(data)) {
		t.Errorf("parsing a crafted %d-byte cache allocated %d bytes, want at most %d", len(data), got, memoryBound(len(data)))
	}
	if err == nil || !strings.Contains(err.Error(), "add up to more than") {
		t.Errorf("a crafted cache: %v, want it refused for its strings' total", err)
	}
	host, err := os.ReadFile("/etc/ld.so.cache")
	if err != nil {
		t.Fatal(err)
	}
	var c *Cache
	if got := allocated(func() { c, err = Parse(host) }); err != nil || got > memoryBound(len(host)) || len(c.Entries) == 0 {
		t.Errorf("the host's cache: %d entries, %d bytes allocated (at most %d), %v", len(c.Entries), got, memoryBound(len(host)), err)
	}
}

// FuzzParse: whatever the bytes, Parse returns (no panic) having allocated
// memory linear in their size, and what it returns marshals into a cache it
// reads back alike.
func FuzzParse(f *testing.F) {
	if host, err := os.ReadFile("/etc/ld.so.cache"); err == nil {
		f.Add(host)
	}
	f.Add(crafted(4 << 10))
	f.Add((&Cache{Entries: []Entry{{Key: "libcuda.so.1", Value: "/usr/lib64/libcuda.so.1", Flags: FlagX8664Lib64}}, HWCapDirs: []string{"x86-64-v3"}}).Marshal())
	f.Fuzz(func(t *testing.T, data []byte) {
		var c *Cache
		var err error
		if got := allocated(func() { c, err = Parse(data) }); got > memoryBound(len(data)) {
			t.Fatalf("parsing %d bytes allocated %d, want at most %d", len(data), got, memoryBound(len(data)))
		}
		if err != nil {
			return
		}
		again, err := Parse(c.Marshal())
		if err != nil {
			t.Fatalf("a parsed cache, marshalled, does not parse: %v", err)
		}
		if len(again.Entries) != len(c.Entries) || len(again.HWCapDirs) != len(c.HWCapDirs) {
			t.Fatalf("round trip: %d entries and %d hwcaps, want %d and %d", len(again.Entries), len(again.HWCapDirs), len(c.Entries), len(c.HWCapDirs))
		}
	})
}
