//! A child process's log, kept for tests to search.

/// Most bytes of a log a test keeps (the oldest lines go first).
const LOG_KEEP: usize = 8 << 20;

/// A child's log, copied line by line to the test's own stderr (so a failing test still
/// shows it) and kept for [`LogTail::find`].
#[derive(Clone, Default)]
pub struct LogTail(std::sync::Arc<std::sync::Mutex<std::collections::VecDeque<String>>>);

impl LogTail {
    /// Reads `output` (a child's stderr or stdout) on a thread of its own until it ends.
    pub fn follow(&self, output: impl std::io::Read + Send + 'static) {
        let tail = self.clone();
        std::thread::spawn(move || {
            use std::io::BufRead;
            let mut kept = 0usize;
            for line in std::io::BufReader::new(output).lines() {
                let Ok(line) = line else { break };
                eprintln!("{line}");
                let mut lines = tail.0.lock().expect("log lock");
                kept += line.len();
                lines.push_back(line);
                while kept > LOG_KEEP {
                    kept -= lines.pop_front().map_or(0, |l| l.len());
                }
            }
        });
    }

    /// The first line kept that holds every one of `needles`.
    pub fn find(&self, needles: &[&str]) -> Option<String> {
        let lines = self.0.lock().expect("log lock");
        lines
            .iter()
            .find(|line| needles.iter().all(|n| line.contains(n)))
            .cloned()
    }
}
