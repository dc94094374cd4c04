//! A cgroup v2 group per service instance, for the faults that cut one
//! instance off the network (relay-cut, payments-db-cut): the stack's
//! firewall rule matches the group (`iptables -m cgroup --path`), so that one
//! process loses its packets while every other keeps the same addresses and
//! the same network.
//!
//! Chaos makes `<cgroup2>/effectively-chaos-<pid>/<label>` for each instance
//! and starts every life of that instance inside it: a shell joins the group,
//! then `exec`s the service (same pid, and no socket of the service exists
//! before it is in the group, which is when the kernel tags a socket with its
//! group). The groups are removed when the run ends.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};

/// The groups of one run.
#[derive(Debug)]
pub struct Groups {
    /// Where the cgroup v2 hierarchy is mounted.
    mount: PathBuf,
    /// This run's group, relative to `mount`.
    base: String,
    labels: Vec<String>,
}

impl Groups {
    /// Makes one group per label under a group of this run's own.
    pub fn create(labels: &[String]) -> anyhow::Result<Self> {
        let mountinfo =
            std::fs::read_to_string("/proc/self/mountinfo").context("read /proc/self/mountinfo")?;
        let Some(mount) = cgroup2_mount(&mountinfo) else {
            bail!(
                "no cgroup v2 hierarchy is mounted (relay-cut and payments-db-cut match a cgroup \
                 v2 group: mount -t cgroup2 none /sys/fs/cgroup/unified)"
            );
        };
        let groups = Self {
            mount,
            base: format!("effectively-chaos-{}", std::process::id()),
            labels: labels.to_vec(),
        };
        for label in labels {
            let dir = groups.mount.join(groups.path(label));
            std::fs::create_dir_all(&dir)
                .with_context(|| format!("create cgroup {} (root only)", dir.display()))?;
        }
        Ok(groups)
    }

    /// `label`'s group, relative to the hierarchy's root, as the firewall's
    /// cgroup match takes it.
    pub fn path(&self, label: &str) -> String {
        format!("{}/{label}", self.base)
    }

    /// The program and arguments that run `program` inside `label`'s group.
    pub fn wrap(&self, label: &str, program: &Path) -> (PathBuf, Vec<OsString>) {
        let procs = self.mount.join(self.path(label)).join("cgroup.procs");
        (
            PathBuf::from("/bin/sh"),
            vec![
                "-c".into(),
                // `echo` is the shell's own: it is the shell that joins.
                "echo 0 >\"$1\" || exit 126; shift; exec \"$@\"".into(),
                "sh".into(),
                procs.into_os_string(),
                program.as_os_str().to_owned(),
            ],
        )
    }
}

impl Drop for Groups {
    fn drop(&mut self) {
        // Empty by now: every life has ended.
        for label in &self.labels {
            let _ = std::fs::remove_dir(self.mount.join(self.path(label)));
        }
        let _ = std::fs::remove_dir(self.mount.join(&self.base));
    }
}

/// Where `/proc/self/mountinfo` says the cgroup v2 hierarchy is mounted.
fn cgroup2_mount(mountinfo: &str) -> Option<PathBuf> {
    mountinfo.lines().find_map(|line| {
        // ID PARENT MAJ:MIN ROOT MOUNT-POINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER
        let (fields, fs) = line.split_once(" - ")?;
        let fstype = fs.split_whitespace().next()?;
        let mount = fields.split_whitespace().nth(4)?;
        (fstype == "cgroup2").then(|| PathBuf::from(mount))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cgroup2_mount_is_found_beside_v1_hierarchies() {
        let hybrid = "\
30 25 0:26 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755
31 30 0:27 / /sys/fs/cgroup/unified rw,nosuid,nodev shared:10 - cgroup2 cgroup2 rw
32 30 0:28 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu";
        assert_eq!(
            cgroup2_mount(hybrid),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
        let unified = "25 1 0:22 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate";
        assert_eq!(
            cgroup2_mount(unified),
            Some(PathBuf::from("/sys/fs/cgroup"))
        );
        assert_eq!(
            cgroup2_mount("32 30 0:28 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu"),
            None
        );
        assert_eq!(cgroup2_mount("garbage\n\n"), None);
    }

    #[test]
    fn a_life_joins_its_group_before_the_service_starts() {
        let groups = Groups {
            mount: PathBuf::from("/sys/fs/cgroup/unified"),
            base: "effectively-chaos-7".into(),
            labels: vec![],
        };
        assert_eq!(groups.path("relay-2"), "effectively-chaos-7/relay-2");
        let (program, args) = groups.wrap("relay-2", Path::new("/bin/relay"));
        assert_eq!(program, PathBuf::from("/bin/sh"));
        assert_eq!(
            args[3],
            OsString::from("/sys/fs/cgroup/unified/effectively-chaos-7/relay-2/cgroup.procs")
        );
        assert_eq!(args[4], OsString::from("/bin/relay"));
    }
}
