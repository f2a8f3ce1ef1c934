// Package redistest runs a real redis-server for tests and benchmarks: Debian's redis-server
// package, on a free port, without persistence. Where it is not installed a test is skipped,
// loudly — or fails when BATON_REQUIRE_REDIS is set, as in CI, which installs it.
package redistest

import (
	"bufio"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"time"
)

// Server is one redis-server process, which a test may stop and start again on the same port.
type Server struct {
	Addr string
	path string
	port int
	dir  string
	cmd  *exec.Cmd
}

// ErrNotInstalled is a machine without redis-server.
var ErrNotInstalled = errors.New("no redis-server on this machine; Debian's redis-server package provides it")

// T is what Start needs of a test (testing.TB has it; the package does not import testing, so
// that the benchmarks may use New).
type T interface {
	Helper()
	Fatal(args ...any)
	Skip(args ...any)
	TempDir() string
	Cleanup(func())
}

// Start starts a redis-server for t, stopped when t ends.
func Start(t T) *Server {
	t.Helper()
	s, err := New(t.TempDir())
	if errors.Is(err, ErrNotInstalled) {
		msg := "SKIPPED: no redis-server to count shared limits in; install Debian's redis-server (CI does)"
		if os.Getenv("BATON_REQUIRE_REDIS") != "" {
			t.Fatal("BATON_REQUIRE_REDIS is set but " + msg)
		}
		t.Skip(msg)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Stop)
	return s
}

// New starts a redis-server on a free port keeping its files in dir, and waits until it
// answers; ErrNotInstalled where there is none. Stop stops it.
func New(dir string) (*Server, error) {
	path, err := exec.LookPath("redis-server")
	if err != nil {
		return nil, ErrNotInstalled
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	s := &Server{Addr: "127.0.0.1:" + strconv.Itoa(port), path: path, port: port, dir: dir}
	if err := s.StartAgain(); err != nil {
		return nil, err
	}
	return s, nil
}

// URL is the server's redis:// URL, database 0.
func (s *Server) URL() string { return "redis://" + s.Addr + "/0" }

// StartAgain starts the server (after Stop) on its port, and waits until it answers.
func (s *Server) StartAgain() error {
	s.cmd = exec.Command(s.path, "--port", strconv.Itoa(s.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
		"--dir", s.dir, "--protected-mode", "no")
	s.cmd.SysProcAttr = dieWithParent()
	if err := s.cmd.Start(); err != nil {
		return err
	}
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		if s.ping() == nil {
			return nil
		}
		time.Sleep(20 * time.Millisecond)
	}
	s.Stop()
	return fmt.Errorf("redis-server on %s did not answer within 10s", s.Addr)
}

// Stop kills the server (as a crash would) and waits for it to exit.
func (s *Server) Stop() {
	if s.cmd == nil || s.cmd.Process == nil {
		return
	}
	_ = s.cmd.Process.Kill()
	_ = s.cmd.Wait()
	s.cmd = nil
}

func (s *Server) ping() error {
	c, err := net.DialTimeout("tcp", s.Addr, 200*time.Millisecond)
	if err != nil {
		return err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(time.Second))
	if _, err := c.Write([]byte("PING\r\n")); err != nil {
		return err
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil || !strings.HasPrefix(line, "+PONG") {
		return fmt.Errorf("ping: %q %v", line, err)
	}
	return nil
}
