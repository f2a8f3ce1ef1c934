package redistest

import "syscall"

// dieWithParent kills the server when the test process dies.
func dieWithParent() *syscall.SysProcAttr { return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL} }
