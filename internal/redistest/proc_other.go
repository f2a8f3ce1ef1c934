//go:build !linux

package redistest

import "syscall"

func dieWithParent() *syscall.SysProcAttr { return nil }
