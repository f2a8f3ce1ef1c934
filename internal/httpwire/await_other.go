//go:build !linux

package httpwire

import "syscall"

// Awaits says whether AwaitData waits here: it does not.
const Awaits = false

// AwaitData returns at once where the one-byte peek is not available: the caller's read waits,
// with its buffer.
func AwaitData(raw syscall.RawConn) error { return nil }

// Pending cannot ask the kernel here: ok false.
func Pending(raw syscall.RawConn) (pending, ok bool) { return false, false }
