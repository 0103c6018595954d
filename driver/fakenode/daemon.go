package fakenode

import (
	"encoding/binary"
	"runtime"
)

// fakeDaemon is the fake driver's nvidia-cuda-mps-control: a real driver's
// daemon (`-f`) runs in the foreground until it is stopped, and so does
// this one, so that the plugin's MPS daemon pod runs in a real container
// (test/cluster's real-runtime nodes) as it would on a GPU node. It is a
// static x86-64 Linux program of a few bytes: it blocks SIGTERM and SIGINT,
// waits for either, and exits 0; it ignores its arguments and opens
// nothing. (A process that waited with the signals' default actions would
// not stop as PID 1 of its container until killed.) Elsewhere than on
// amd64 it is a script that fails, like the other fake tools.
//
// The code, position-independent (GNU as, Intel syntax):
//
//	    mov eax, 14            ; rt_sigprocmask(SIG_BLOCK, &set, NULL, 8)
//	    xor edi, edi
//	    lea rsi, [rip+set]
//	    xor edx, edx
//	    mov r10d, 8
//	    syscall
//	1:  mov eax, 128           ; rt_sigtimedwait(&set, NULL, NULL, 8)
//	    lea rdi, [rip+set]
//	    xor esi, esi
//	    xor edx, edx
//	    mov r10d, 8
//	    syscall
//	    cmp eax, 15            ; SIGTERM
//	    je 2f
//	    cmp eax, 2             ; SIGINT
//	    jne 1b
//	2:  mov eax, 231           ; exit_group(0)
//	    xor edi, edi
//	    syscall
//	set: .quad 0x4002          ; SIGTERM and SIGINT
func fakeDaemon() []byte {
	if runtime.GOARCH != "amd64" {
		return []byte("#!/bin/false\n")
	}
	code := []byte{
		0xb8, 0x0e, 0x00, 0x00, 0x00, 0x31, 0xff, 0x48, 0x8d, 0x35, 0x35, 0x00,
		0x00, 0x00, 0x31, 0xd2, 0x41, 0xba, 0x08, 0x00, 0x00, 0x00, 0x0f, 0x05,
		0xb8, 0x80, 0x00, 0x00, 0x00, 0x48, 0x8d, 0x3d, 0x1f, 0x00, 0x00, 0x00,
		0x31, 0xf6, 0x31, 0xd2, 0x41, 0xba, 0x08, 0x00, 0x00, 0x00, 0x0f, 0x05,
		0x83, 0xf8, 0x0f, 0x74, 0x05, 0x83, 0xf8, 0x02, 0x75, 0xde, 0xb8, 0xe7,
		0x00, 0x00, 0x00, 0x31, 0xff, 0x0f, 0x05, 0x02, 0x40, 0x00, 0x00, 0x00,
		0x00, 0x00, 0x00,
	}
	// One ELF header, one loadable segment holding the whole file at
	// base, the code right after the headers.
	const base, ehsize, phsize = 0x400000, 64, 56
	le := binary.LittleEndian
	f := make([]byte, ehsize+phsize, ehsize+phsize+len(code))
	copy(f, []byte{0x7f, 'E', 'L', 'F', 2 /* 64-bit */, 1 /* little-endian */, 1 /* version */})
	le.PutUint16(f[16:], 2)    // ET_EXEC
	le.PutUint16(f[18:], 0x3e) // EM_X86_64
	le.PutUint32(f[20:], 1)    // EV_CURRENT
	le.PutUint64(f[24:], base+ehsize+phsize)
	le.PutUint64(f[32:], ehsize) // program headers
	le.PutUint16(f[52:], ehsize)
	le.PutUint16(f[54:], phsize)
	le.PutUint16(f[56:], 1)
	ph := f[ehsize:]
	le.PutUint32(ph[0:], 1) // PT_LOAD
	le.PutUint32(ph[4:], 5) // PF_R | PF_X
	le.PutUint64(ph[16:], base)
	le.PutUint64(ph[24:], base)
	size := uint64(ehsize + phsize + len(code))
	le.PutUint64(ph[32:], size)
	le.PutUint64(ph[40:], size)
	le.PutUint64(ph[48:], 0x1000)
	return append(f, code...)
}
