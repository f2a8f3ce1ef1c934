package config

import (
	"fmt"
	"io"
	"os"
	"syscall"
)

// Bounds on the files Baton reads: its configuration, smg's policy files, key and certificate
// files.
const (
	MaxConfigFile = 16 << 20
	MaxSmallFile  = 1 << 20 // a key, a certificate, a policy file
)

// ReadFile reads a regular file of at most max bytes: a device (a path linked to /dev/zero), a
// directory or a pipe is refused, and so is a file past max, before more than max+1 bytes are
// read — a file Baton reads at startup or on every reload cannot hold it.
func ReadFile(path string, max int64) ([]byte, error) {
	// Looked at before it is opened, and opened without blocking: opening a named pipe would
	// wait for a writer for ever.
	if st, err := os.Stat(path); err != nil {
		return nil, err
	} else if !st.Mode().IsRegular() {
		return nil, fmt.Errorf("%s is not a regular file", path)
	}
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if !st.Mode().IsRegular() {
		return nil, fmt.Errorf("%s is not a regular file", path)
	}
	b, err := io.ReadAll(io.LimitReader(f, max+1))
	if err != nil {
		return nil, err
	}
	if int64(len(b)) > max {
		return nil, fmt.Errorf("%s is larger than the %d bytes such a file may have", path, max)
	}
	return b, nil
}
