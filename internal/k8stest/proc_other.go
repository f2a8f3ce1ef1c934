//go:build !linux

package k8stest

import "syscall"

// dieWithParent is nothing where there is no parent-death signal: a child outlives a test
// process that is killed (one that ends normally stops its children itself).
func dieWithParent() *syscall.SysProcAttr { return nil }
