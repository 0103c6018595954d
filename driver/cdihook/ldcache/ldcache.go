// Package ldcache reads and writes glibc's loader cache (/etc/ld.so.cache)
// in the format glibc's dynamic loader reads: the "glibc-ld.so.cache1.1"
// table of (soname, path) entries sorted for the loader's binary search,
// its string table and its extension directory. It reads the caches every
// glibc since 2.2 writes (that table alone, or behind the old libc5 one) and
// writes that table alone, which every such loader reads.
package ldcache

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"strings"
)

// Entry flags: an ELF library for glibc (FLAG_ELF_LIBC6) of the
// architecture's 64-bit ABI, as the loader of that architecture wants them
// (its _DL_CACHE_DEFAULT_ID).
const (
	FlagELFLibc6   = 0x0003
	FlagX8664Lib64 = 0x0300 | FlagELFLibc6
	FlagAArch64    = 0x0a00 | FlagELFLibc6
)

const (
	magicOld     = "ld.so-1.7.0"
	magicNew     = "glibc-ld.so.cache1.1"
	headerSize   = 48 // struct cache_file_new
	entrySize    = 24 // struct file_entry_new
	oldEntrySize = 12 // struct file_entry
	// extensionMagic marks the extension directory.
	extensionMagic = 0xeaa42174
	tagGenerator   = 0
	tagHWCaps      = 1
	// endianLittle is the header's flags for a little-endian cache; both
	// architectures Tessera runs on are little-endian.
	endianLittle = 2
)

// Entry is one library in the cache.
type Entry struct {
	// Key is the name programs ask for (a soname), Value the file's path.
	Key, Value string
	Flags      int32
	OSVersion  uint32
	// HWCap is the entry's hardware capability bits; with bit 62 set its
	// low 32 bits index Cache.HWCapDirs (a glibc-hwcaps subdirectory).
	HWCap uint64
}

// Cache is a loader cache's content.
type Cache struct {
	// Entries are in the loader's order (Compare, descending by key).
	Entries []Entry
	// HWCapDirs are the glibc-hwcaps subdirectories entries refer to.
	HWCapDirs []string
	// Generator says what wrote the cache.
	Generator string
}

var le = binary.LittleEndian

// MaxStringBytes bounds what Parse decodes: the entries' keys and values,
// and the hwcaps directories' names, may add up to at most this many times
// the file's size (plus a constant for tiny files). glibc's ldconfig shares
// a key's bytes with the tail of its value, so a real cache decodes to about
// twice its string table; a crafted one can point thousands of entries into
// one long string, and would cost memory and time in the square of its size
// if decoded whole.
const MaxStringBytes = 4

// Parse reads a loader cache file, in time and memory linear in its size.
func Parse(data []byte) (*Cache, error) {
	base := 0
	if bytes.HasPrefix(data, []byte(magicOld)) {
		// The old table first, the new one after it, aligned.
		if len(data) < 16 {
			return nil, errors.New("loader cache: truncated old-format header")
		}
		// struct cache_file is 16 bytes (the magic, padded to 12 for
		// nlibs), its entries 12 each; the new table follows, aligned to 8.
		n := int(le.Uint32(data[12:]))
		if n < 0 || n > len(data)/oldEntrySize {
			return nil, fmt.Errorf("loader cache: %d old-format entries do not fit", n)
		}
		base = align(16+n*oldEntrySize, 8)
	}
	if len(data) < base+headerSize || !bytes.Equal(data[base:base+len(magicNew)], []byte(magicNew)) {
		return nil, errors.New("loader cache: no glibc-ld.so.cache1.1 table")
	}
	h := data[base:]
	if flags := h[28] & 3; flags != 0 && flags != endianLittle {
		return nil, fmt.Errorf("loader cache: byte order flags %d, want little-endian", flags)
	}
	n := int(le.Uint32(h[20:]))
	if n < 0 || (len(h)-headerSize)/entrySize < n {
		return nil, fmt.Errorf("loader cache: %d entries do not fit in %d bytes", n, len(h))
	}
	// One copy of the table; every string is a part of it, and what is
	// decoded and scanned stays within budget.
	hs := string(h)
	budget := MaxStringBytes*len(data) + 64<<10
	str := func(off uint32) (string, error) {
		if int(off) >= len(hs) {
			return "", fmt.Errorf("loader cache: string offset %d beyond the file", off)
		}
		window := hs[off:min(len(hs), int(off)+budget+1)]
		end := strings.IndexByte(window, 0)
		switch {
		case end < 0 && len(window) <= budget:
			return "", fmt.Errorf("loader cache: string at %d is not terminated", off)
		case end < 0:
			return "", fmt.Errorf("loader cache: its strings add up to more than %d times its %d bytes; not a cache ldconfig writes", MaxStringBytes, len(data))
		}
		budget -= end + 1
		return window[:end], nil
	}
	c := &Cache{}
	for i := range n {
		e := h[headerSize+i*entrySize:]
		key, err := str(le.Uint32(e[4:]))
		if err != nil {
			return nil, err
		}
		value, err := str(le.Uint32(e[8:]))
		if err != nil {
			return nil, err
		}
		c.Entries = append(c.Entries, Entry{Key: key, Value: value, Flags: int32(le.Uint32(e[0:])), OSVersion: le.Uint32(e[12:]), HWCap: le.Uint64(e[16:])})
	}
	if ext := int(le.Uint32(h[32:])); ext != 0 {
		if err := c.parseExtensions(data, ext, func(off uint32) (string, error) {
			// Extension data refers to the file; strings to the table's
			// start, the same in every file that has extensions.
			return str(off - uint32(base))
		}); err != nil {
			return nil, err
		}
	}
	return c, nil
}

func (c *Cache) parseExtensions(data []byte, off int, str func(uint32) (string, error)) error {
	if off%4 != 0 || off+8 > len(data) || le.Uint32(data[off:]) != extensionMagic {
		return fmt.Errorf("loader cache: bad extension directory at %d", off)
	}
	count := int(le.Uint32(data[off+4:]))
	if count < 0 || (len(data)-off-8)/16 < count {
		return fmt.Errorf("loader cache: %d extension sections do not fit", count)
	}
	for i := range count {
		s := data[off+8+16*i:]
		tag, start, size := le.Uint32(s[0:]), int(le.Uint32(s[8:])), int(le.Uint32(s[12:]))
		if start < 0 || size < 0 || start+size > len(data) {
			return fmt.Errorf("loader cache: extension section %d beyond the file", i)
		}
		body := data[start : start+size]
		switch tag {
		case tagGenerator:
			c.Generator = string(body)
		case tagHWCaps:
			if size%4 != 0 {
				return fmt.Errorf("loader cache: glibc-hwcaps section of %d bytes", size)
			}
			for j := 0; j < size; j += 4 {
				name, err := str(le.Uint32(body[j:]))
				if err != nil {
					return err
				}
				c.HWCapDirs = append(c.HWCapDirs, name)
			}
		}
		// Other tags are data the loader does not know either: dropped.
	}
	return nil
}

// Set puts entries into the cache in the loader's order, replacing every
// entry with the same key: the cache then resolves each key to its new
// entry.
func (c *Cache) Set(entries ...Entry) {
	keys := map[string]bool{}
	for _, e := range entries {
		keys[e.Key] = true
	}
	c.Entries = slices.DeleteFunc(c.Entries, func(e Entry) bool { return keys[e.Key] })
	c.Entries = append(c.Entries, entries...)
	// Stable: entries of one key keep the order the cache had them in
	// (the loader prefers the first that fits).
	slices.SortStableFunc(c.Entries, func(a, b Entry) int { return Compare(b.Key, a.Key) })
}

// Marshal writes the cache as glibc's loader reads it.
func (c *Cache) Marshal() []byte {
	var strs bytes.Buffer
	offsets := map[string]uint32{}
	start := uint32(headerSize + entrySize*len(c.Entries))
	intern := func(s string) uint32 {
		if off, ok := offsets[s]; ok {
			return off
		}
		off := start + uint32(strs.Len())
		strs.WriteString(s)
		strs.WriteByte(0)
		offsets[s] = off
		return off
	}
	out := make([]byte, headerSize, int(start)+256)
	copy(out, magicNew)
	le.PutUint32(out[20:], uint32(len(c.Entries)))
	out[28] = endianLittle
	for _, e := range c.Entries {
		var b [entrySize]byte
		le.PutUint32(b[0:], uint32(e.Flags))
		le.PutUint32(b[4:], intern(e.Key))
		le.PutUint32(b[8:], intern(e.Value))
		le.PutUint32(b[12:], e.OSVersion)
		le.PutUint64(b[16:], e.HWCap)
		out = append(out, b[:]...)
	}
	var hwcaps []uint32
	for _, d := range c.HWCapDirs {
		hwcaps = append(hwcaps, intern(d))
	}
	le.PutUint32(out[24:], uint32(strs.Len()))
	out = append(out, strs.Bytes()...)

	// The extension directory: the generator and the hwcaps directories.
	out = pad(out, 8)
	le.PutUint32(out[32:], uint32(len(out)))
	sections := 1
	if len(hwcaps) > 0 {
		sections++
	}
	dir := len(out)
	out = append(out, make([]byte, 8+16*sections)...)
	le.PutUint32(out[dir:], extensionMagic)
	le.PutUint32(out[dir+4:], uint32(sections))
	section := func(i int, tag uint32, body []byte) {
		out = pad(out, 4)
		s := out[dir+8+16*i:]
		le.PutUint32(s[0:], tag)
		le.PutUint32(s[8:], uint32(len(out)))
		le.PutUint32(s[12:], uint32(len(body)))
		out = append(out, body...)
	}
	section(0, tagGenerator, []byte(cmpOr(c.Generator, "tessera-cdi-hook")))
	if len(hwcaps) > 0 {
		body := make([]byte, 4*len(hwcaps))
		for i, off := range hwcaps {
			le.PutUint32(body[4*i:], off)
		}
		section(1, tagHWCaps, body)
	}
	return out
}

// Compare orders keys as glibc's loader does (_dl_cache_libcmp): runs of
// digits compare as numbers, so libfoo.so.10 sorts after libfoo.so.9, and
// a digit sorts after any other byte. The cache lists keys from the
// greatest down.
func Compare(a, b string) int {
	i, j := 0, 0
	for i < len(a) {
		switch {
		case isDigit(a[i]) && j < len(b) && isDigit(b[j]):
			var x, y int
			for ; i < len(a) && isDigit(a[i]); i++ {
				x = x*10 + int(a[i]-'0')
			}
			for ; j < len(b) && isDigit(b[j]); j++ {
				y = y*10 + int(b[j]-'0')
			}
			if x != y {
				return cmpInt(x, y)
			}
		case isDigit(a[i]):
			return 1
		case j < len(b) && isDigit(b[j]):
			return -1
		case j >= len(b):
			return 1
		case a[i] != b[j]:
			return cmpInt(int(a[i]), int(b[j]))
		default:
			i++
			j++
		}
	}
	if j < len(b) {
		return -1
	}
	return 0
}

func isDigit(c byte) bool { return c >= '0' && c <= '9' }

func cmpInt(x, y int) int {
	switch {
	case x < y:
		return -1
	case x > y:
		return 1
	}
	return 0
}

func align(n, to int) int { return (n + to - 1) / to * to }

func pad(b []byte, to int) []byte {
	for len(b)%to != 0 {
		b = append(b, 0)
	}
	return b
}

func cmpOr(a, b string) string {
	if a != "" {
		return a
	}
	return b
}
