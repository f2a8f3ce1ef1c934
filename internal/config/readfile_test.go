package config

import (
	"io"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

// Every file Baton reads is bounded: a path linked to /dev/zero, a named pipe (opening one waits
// for a writer), a directory or a file past its bound is refused at once, naming the flag — not
// read until memory runs out, nor waited on for ever.
func TestFilesAreBounded(t *testing.T) {
	if _, err := os.Stat("/dev/zero"); err != nil {
		t.Skipf("SKIP (loud): no /dev/zero on this system: %v", err)
	}
	dir := t.TempDir()
	zero := filepath.Join(dir, "zero")
	if err := os.Symlink("/dev/zero", zero); err != nil {
		t.Fatal(err)
	}
	fifo := filepath.Join(dir, "fifo")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	big := filepath.Join(dir, "big")
	if err := os.WriteFile(big, make([]byte, MaxSmallFile+1), 0o600); err != nil {
		t.Fatal(err)
	}
	tenants := filepath.Join(dir, "tenants.yaml")
	os.WriteFile(tenants, []byte("tenants:\n  - {name: a, key_file: "+zero+"}\n"), 0o600)
	for _, args := range [][]string{
		{"--config", zero},
		{"--config", fifo},
		{"--api-key-file", fifo},
		{"--config", dir},
		{"--client-api-key-file", zero},
		{"--api-key-file", big},
		{"--admin-api-key-file", zero},
		{"--tenant-rate-limit-enabled", "--tenant-rate-limit-config", zero},
		{"--priority-scheduler-enabled", "--max-concurrent-requests", "4", "--priority-scheduler-config", big},
		{"--config", tenants},
	} {
		_, err := Parse(append([]string{"--worker-urls", "http://w:8000"}, args...), io.Discard)
		if err == nil || !(strings.Contains(err.Error(), "not a regular file") || strings.Contains(err.Error(), "larger than")) {
			t.Errorf("%v: %v", args, err)
		}
	}
}
