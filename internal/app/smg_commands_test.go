package app

import (
	"crypto/tls"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/sim"
)

// smgCommandLine is one documented smg command line and what Baton does with it.
type smgCommandLine struct {
	outcome, source string
	args            []string
}

// smgCommandLines reads testdata/smg-command-lines.txt.
func smgCommandLines(t *testing.T) []smgCommandLine {
	t.Helper()
	b, err := os.ReadFile("testdata/smg-command-lines.txt")
	if err != nil {
		t.Fatal(err)
	}
	var out []smgCommandLine
	for _, line := range strings.Split(string(b), "\n") {
		if line = strings.TrimSpace(line); line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		parts := strings.SplitN(line, " | ", 3)
		if len(parts) != 3 {
			t.Fatalf("malformed line %q", line)
		}
		args := strings.Fields(parts[2])
		for len(args) > 0 && (args[0] == "smg" || args[0] == "launch" || args[0] == "serve") {
			args = args[1:]
		}
		out = append(out, smgCommandLine{outcome: parts[0], source: parts[1], args: args})
	}
	return out
}

// Every command line smg's guides give (getting started, PD, discovery, rate limits,
// authentication, observability, reliability) does in Baton what the test data says: it serves
// — the same command line, its hosts replaced by simulated engines, answers a request — or it
// is refused at startup with the line that names Baton's way. None is a bare "unknown flag".
func TestSmgDocumentedCommandLines(t *testing.T) {
	lines := smgCommandLines(t)
	if len(lines) < 28 {
		t.Fatalf("%d command lines: want at least smg's 28 of the guides", len(lines))
	}
	dir := t.TempDir()
	certPath, keyPath := filepath.Join(dir, "server.crt"), filepath.Join(dir, "server.key")
	writeCert(t, certPath, keyPath, "smg-docs")
	for i, c := range lines {
		t.Run(strconv.Itoa(i+1)+" "+c.source, func(t *testing.T) {
			switch {
			case strings.HasPrefix(c.outcome, "refused: "):
				want := strings.TrimPrefix(c.outcome, "refused: ")
				if _, err := config.Parse(c.args, io.Discard); err == nil || !strings.Contains(err.Error(), want) {
					t.Errorf("%v: %v, want a refusal naming %q", c.args, err, want)
				}
			case c.outcome == "parses":
				if _, err := config.Parse(c.args, io.Discard); err != nil {
					t.Errorf("%v: %v", c.args, err)
				}
			case c.outcome == "serves":
				args, key := smgOverSims(t, c.args, certPath, keyPath)
				r := startRun(t, args...)
				client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}}
				defer client.CloseIdleConnections()
				var status int
				var body string
				for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
					req, _ := http.NewRequest(http.MethodPost, r.api+"/v1/completions", strings.NewReader(`{"model":"m","prompt":"from smg's docs","max_tokens":2}`))
					if key != "" {
						req.Header.Set("Authorization", "Bearer "+key)
					}
					resp, err := client.Do(req)
					if err != nil {
						t.Fatal(err)
					}
					b, _ := io.ReadAll(resp.Body)
					resp.Body.Close()
					if status, body = resp.StatusCode, string(b); status == 200 {
						return
					}
				}
				t.Errorf("%v: %d %s", args, status, body)
			default:
				t.Fatalf("unknown outcome %q", c.outcome)
			}
		})
	}
}

// smgOverSims rewrites a documented command line to run here: --host and --port dropped (the
// test's run picks them), each worker URL a simulated engine (SGLang prefill and decode for
// --prefill and --decode, the prefill's bootstrap port for the one given), certificate paths
// the test's. key is a client key the line gives tenants, "" when none.
func smgOverSims(t *testing.T, in []string, certPath, keyPath string) (args []string, key string) {
	t.Helper()
	for i := 0; i < len(in); i++ {
		a := in[i]
		switch {
		case a == "--host" || a == "--port":
			i++
		case a == "--tls-cert-path" || a == "--tls-key-path":
			args = append(args, a, map[string]string{"--tls-cert-path": certPath, "--tls-key-path": keyPath}[a])
			i++
		case a == "--api-key" && key == "": // smg checks it on clients too
			key = in[i+1]
			args = append(args, a)
		case a == "--tenant-api-key":
			if key == "" {
				_, key, _ = strings.Cut(in[i+1], ":")
			}
			args = append(args, a)
		case a == "--prefill":
			p := simEngine(t, sim.Config{Engine: sim.EngineSGLang, Role: sim.RolePrefill})
			args = append(args, a, p.URL())
			i++
			if i+1 < len(in) && !strings.HasPrefix(in[i+1], "-") {
				args = append(args, strconv.Itoa(p.BootstrapPort()))
				i++
			}
		case a == "--decode":
			args = append(args, a, simEngine(t, sim.Config{Engine: sim.EngineSGLang, Role: sim.RoleDecode}).URL())
			i++
		case strings.HasPrefix(a, "http://") || strings.HasPrefix(a, "https://"):
			args = append(args, simEngine(t, sim.Config{Engine: sim.EngineVLLM}).URL())
		default:
			args = append(args, a)
		}
	}
	return args, key
}
