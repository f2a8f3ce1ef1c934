package bench

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// clockTicks is the kernel's USER_HZ, the unit of /proc/<pid>/stat CPU times.
const clockTicks = 100

// proc is a child process under measurement (Baton or nginx).
type proc struct {
	cmd        *exec.Cmd
	URL        string
	MetricsURL string // Baton's /metrics, "" for nginx
	grpcAddr   string // baton epp's gRPC listener
	logs       *procLog
	heapInUse  atomic.Bool // heldBytes read the heap in use: the build has no live-heap metric
}

// procLog is a process's stderr, read while the process writes it: its first MiB, the time
// each of its first lines of level WARN or ERROR came (the soak looks for them), and its latest
// lines naming a request id (a Baton's access log: the soak shows what Baton logged of a request
// that failed).
type procLog struct {
	mu      sync.Mutex
	b       strings.Builder
	partial []byte
	alerts  []logLine
	byID    map[string]string
	ids     []string // byID's keys in the order their lines came, a ring of procLogIDs
	next    int      // the ring's oldest
}

// logLine is a line of a process's log and when it came.
type logLine struct {
	at   time.Time
	line string
}

const (
	procLogBytes  = 1 << 20
	procLogAlerts = 10_000
	procLogIDs    = 400_000
)

func (l *procLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.b.Len() < procLogBytes {
		l.b.Write(p[:min(len(p), procLogBytes-l.b.Len())])
	}
	now := time.Now()
	rest := p
	for {
		i := bytes.IndexByte(rest, '\n')
		if i < 0 {
			if len(l.partial) < 64<<10 {
				l.partial = append(l.partial, rest...)
			}
			return len(p), nil
		}
		line := append(l.partial, rest[:i]...)
		l.partial, rest = l.partial[:0], rest[i+1:]
		if len(l.alerts) < procLogAlerts && (bytes.Contains(line, []byte("level=WARN")) || bytes.Contains(line, []byte("level=ERROR"))) {
			l.alerts = append(l.alerts, logLine{now, string(line)})
		}
		l.keepByID(line)
	}
}

// keepByID keeps a line naming a request id (request_id=…), forgetting the oldest past
// procLogIDs.
func (l *procLog) keepByID(line []byte) {
	_, rest, ok := bytes.Cut(line, []byte(" request_id="))
	if !ok {
		return
	}
	id := rest
	if i := bytes.IndexByte(rest, ' '); i >= 0 {
		id = rest[:i]
	}
	if len(id) == 0 || len(id) > 256 {
		return
	}
	if l.byID == nil {
		l.byID = map[string]string{}
	}
	key := string(id)
	if len(l.ids) < procLogIDs {
		l.ids = append(l.ids, key)
	} else {
		delete(l.byID, l.ids[l.next])
		l.ids[l.next] = key
		l.next = (l.next + 1) % procLogIDs
	}
	l.byID[key] = string(line)
}

// lineOf returns the latest line naming request id, if it is still held.
func (l *procLog) lineOf(id string) (string, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	line, ok := l.byID[id]
	return line, ok
}

// alertsSince returns the WARN and ERROR lines that came at or after t.
func (l *procLog) alertsSince(t time.Time) []logLine {
	l.mu.Lock()
	defer l.mu.Unlock()
	i, _ := slices.BinarySearchFunc(l.alerts, t, func(a logLine, t time.Time) int { return a.at.Compare(t) })
	return slices.Clone(l.alerts[i:])
}

func (l *procLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// pinned prefixes argv with taskset pinning it to cpu, when taskset exists and the machine has
// more than one core.
func pinned(cpu int, argv ...string) []string {
	if path, err := exec.LookPath("taskset"); err == nil && numCPU() > 1 && cpu >= 0 {
		return append([]string{path, "-c", strconv.Itoa(cpu)}, argv...)
	}
	return argv
}

var servingLine = regexp.MustCompile(`baton serving on (http://\S+) \(metrics on (http://\S+)\)`)

// startBaton starts `baton serve` with args on its own core and waits until it is ready.
func startBaton(binary string, cpu int, args ...string) (*proc, error) {
	return startBatonEnv(binary, cpu, nil, args...)
}

// startBatonServing starts `baton serve` with args and returns once it listens, ready or not
// (a fleet whose workers are not up yet).
func startBatonServing(binary string, cpu int, args ...string) (*proc, error) {
	argv := append([]string{binary, "serve", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--log-level", "error", "--enable-pprof"}, args...)
	p, m, err := startUntil(pinned(cpu, argv...), servingLine, "baton")
	if err != nil {
		return nil, err
	}
	p.URL, p.MetricsURL = m[1], m[2]
	return p, nil
}

// startBatonEnv is startBaton with env (NAME=value) added to Baton's environment.
func startBatonEnv(binary string, cpu int, env []string, args ...string) (*proc, error) {
	argv := append([]string{binary, "serve", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--log-level", "error", "--enable-pprof"}, args...)
	if len(env) > 0 {
		argv = append(append([]string{"env"}, env...), argv...)
	}
	p, m, err := startUntil(pinned(cpu, argv...), servingLine, "baton")
	if err != nil {
		return nil, err
	}
	p.URL, p.MetricsURL = m[1], m[2]
	deadline := time.Now().Add(60 * time.Second)
	for {
		resp, err := http.Get(p.URL + "/readiness")
		if err == nil {
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode == 200 && allRegistered(p.URL) {
				return p, nil
			}
		}
		if time.Now().After(deadline) {
			p.stop()
			return nil, fmt.Errorf("baton never became ready: %s", p.logs.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

var simLine = regexp.MustCompile(`serving on (http://\S+)`)

// startSim starts `baton sim` with args on cpu and waits until it serves.
func startSim(binary string, cpu int, args ...string) (*proc, error) {
	p, m, err := startUntil(pinned(cpu, append([]string{binary, "sim"}, args...)...), simLine, "the simulator")
	if err != nil {
		return nil, err
	}
	p.URL = m[1]
	return p, nil
}

// startUntil starts argv and waits (30 s at most) for the first line of its output that line
// matches; its standard error is kept in the process's logs.
func startUntil(argv []string, line *regexp.Regexp, what string) (*proc, []string, error) {
	p, ms, err := startUntilAll(argv, what, line)
	if err != nil {
		return nil, nil, err
	}
	return p, ms[0], nil
}

// startUntilAll starts argv and waits (30 s at most) until each of lines matched a line of its
// output, and returns the first match of each.
func startUntilAll(argv []string, what string, lines ...*regexp.Regexp) (*proc, [][]string, error) {
	cmd := exec.Command(argv[0], argv[1:]...)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, nil, err
	}
	p := &proc{cmd: cmd, logs: &procLog{}}
	cmd.Stderr = p.logs
	if err := cmd.Start(); err != nil {
		return nil, nil, err
	}
	matched := make(chan [][]string, 1)
	go func() {
		ms := make([][]string, len(lines))
		left := len(lines)
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			for i, re := range lines {
				if m := re.FindStringSubmatch(sc.Text()); m != nil && ms[i] == nil {
					ms[i] = m
					if left--; left == 0 {
						matched <- ms
					}
				}
			}
		}
	}()
	select {
	case ms := <-matched:
		return p, ms, nil
	case <-time.After(30 * time.Second):
		p.stop()
		return nil, nil, fmt.Errorf("%s did not start: %s", what, p.logs.String())
	}
}

// allRegistered reports whether every worker of the Baton at url has registered.
func allRegistered(url string) bool {
	resp, err := http.Get(url + "/workers")
	if err != nil {
		return false
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return !strings.Contains(string(b), `"registered":false`)
}

// Nginx is an nginx process run as a plain reverse proxy, as the README advises in front of
// Baton (tests use it for what a same-host proxy does to requests).
type Nginx struct {
	p   *proc
	URL string // http://127.0.0.1:port
}

// StartNginx starts nginx, on no particular core, as a plain reverse proxy to upstream
// (http://host:port); nil and no error when nginx is not installed.
func StartNginx(upstream string) (*Nginx, error) {
	p, err := startNginx(-1, upstream)
	if p == nil || err != nil {
		return nil, err
	}
	return &Nginx{p: p, URL: p.URL}, nil
}

// Stop stops nginx.
func (n *Nginx) Stop() { n.p.stop() }

// startNginx starts nginx on core cpu (-1: any) as a plain reverse proxy to upstream, or returns
// nil when nginx is not installed.
func startNginx(cpu int, upstream string) (*proc, error) {
	bin, err := exec.LookPath("nginx")
	if err != nil {
		for _, p := range []string{"/usr/sbin/nginx", "/usr/local/sbin/nginx"} {
			if _, serr := os.Stat(p); serr == nil {
				bin, err = p, nil
			}
		}
	}
	if err != nil {
		return nil, nil
	}
	dir, err := os.MkdirTemp("", "baton-bench-nginx")
	if err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	addr := ln.Addr().String()
	ln.Close()
	conf := fmt.Sprintf(`worker_processes 1;
pid %[1]s/nginx.pid;
error_log %[1]s/error.log error;
events { worker_connections 8192; }
http {
  access_log off;
  client_body_temp_path %[1]s/body; proxy_temp_path %[1]s/proxy; fastcgi_temp_path %[1]s/fastcgi;
  uwsgi_temp_path %[1]s/uwsgi; scgi_temp_path %[1]s/scgi;
  client_max_body_size 0; client_body_buffer_size 2m;
  upstream engine { server %[2]s; keepalive 256; }
  server {
    listen %[3]s;
    location / {
      proxy_pass http://engine; proxy_http_version 1.1; proxy_set_header Connection "";
      proxy_buffering off; proxy_request_buffering on; proxy_read_timeout 3600s;
    }
  }
}
`, dir, strings.TrimPrefix(upstream, "http://"), addr)
	path := filepath.Join(dir, "nginx.conf")
	if err := os.WriteFile(path, []byte(conf), 0o600); err != nil {
		return nil, err
	}
	argv := pinned(cpu, bin, "-c", path, "-g", "daemon off;")
	cmd := exec.Command(argv[0], argv[1:]...)
	p := &proc{cmd: cmd, URL: "http://" + addr, logs: &procLog{}}
	cmd.Stderr = p.logs
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		if c, err := net.Dial("tcp", addr); err == nil {
			c.Close()
			return p, nil
		}
		if time.Now().After(deadline) {
			p.stop()
			return nil, fmt.Errorf("nginx did not start: %s", p.logs.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (p *proc) stop() {
	if p == nil || p.cmd.Process == nil {
		return
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan struct{})
	go func() { _ = p.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		_ = p.cmd.Process.Kill()
		<-done
	}
}

// pids returns the process and, for nginx, its worker children.
func (p *proc) pids() []int {
	pid := p.cmd.Process.Pid
	out := []int{pid}
	// taskset execs the program in place, so pid is the program; nginx forks its worker.
	if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", pid, pid)); err == nil {
		for _, f := range strings.Fields(string(b)) {
			if c, err := strconv.Atoi(f); err == nil {
				out = append(out, c)
			}
		}
	}
	return out
}

// cpuSeconds is the user+system CPU time the process (and its children) used so far.
func (p *proc) cpuSeconds() float64 {
	total := 0.0
	for _, pid := range p.pids() {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			continue
		}
		// Fields after the command name (which is in parentheses and may hold spaces).
		f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+2:]))
		ut, _ := strconv.ParseFloat(f[11], 64)
		st, _ := strconv.ParseFloat(f[12], 64)
		total += (ut + st) / clockTicks
	}
	return total
}

// rssBytes is the resident memory of the process.
func (p *proc) rssBytes() int64 { return p.statusBytes("VmRSS:") }

// statusBytes reads a memory field ("VmRSS:", "VmHWM:") of /proc/<pid>/status.
func (p *proc) statusBytes(field string) int64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", p.cmd.Process.Pid))
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, field); ok {
			kb, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			return kb << 10
		}
	}
	return 0
}

// numCPU is the number of online CPUs of the machine (not of this process's affinity mask,
// which is one CPU once the harness pinned itself).
func numCPU() int {
	b, err := os.ReadFile("/sys/devices/system/cpu/online")
	if err != nil {
		return runtime.NumCPU()
	}
	n := 0
	for _, part := range strings.Split(strings.TrimSpace(string(b)), ",") {
		lo, hi, found := strings.Cut(part, "-")
		a, err1 := strconv.Atoi(lo)
		z := a
		var err2 error
		if found {
			z, err2 = strconv.Atoi(hi)
		}
		if err1 != nil || err2 != nil {
			return runtime.NumCPU()
		}
		n += z - a + 1
	}
	return n
}

// metric reads one unlabelled sample (e.g. go_goroutines) from Baton's /metrics.
func (p *proc) metric(name string) float64 {
	if p.MetricsURL == "" {
		return 0
	}
	resp, err := http.Get(p.MetricsURL)
	if err != nil {
		return 0
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), name+" "); ok {
			f, _ := strconv.ParseFloat(v, 64)
			return f
		}
	}
	return 0
}

// heldBytes returns the Go heap reachable after two collections (the second frees what sync
// pools let go of in the first) and the goroutine stacks: what the process holds, without the
// garbage a collector paces ahead of. The heap is what the second collection found reachable
// (go_gc_heap_live_bytes), so the garbage streams make between it and the metrics' read is not
// counted; a build from before that metric is read by its heap in use, garbage and all.
func (p *proc) heldBytes() (heap, stacks float64) {
	p.liveHeapBytes()
	p.liveHeapBytes()
	heap = p.metric("go_gc_heap_live_bytes")
	if heap == 0 {
		heap = p.metric("go_memstats_heap_alloc_bytes")
		p.heapInUse.Store(true)
	}
	return heap, p.metric("go_memstats_stack_inuse_bytes")
}

// heldNote says, after heldBytes, when the build's heap was read by its heap in use.
func (p *proc) heldNote() string {
	if !p.heapInUse.Load() {
		return ""
	}
	return " (a build without go_gc_heap_live_bytes: its heap in use after the collection, the garbage made since included)"
}

// liveHeapBytes forces a garbage collection in Baton (through pprof) and returns its heap in use.
func (p *proc) liveHeapBytes() float64 {
	if p.MetricsURL == "" {
		return 0
	}
	if resp, err := http.Get(strings.TrimSuffix(p.MetricsURL, "/metrics") + "/debug/pprof/heap?gc=1"); err == nil {
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	return p.metric("go_memstats_heap_inuse_bytes")
}
